"""One launch per world size for both equality gates (tests/parallel/gate.py and pipeline_gate.py).

``test_parallel_gate.py`` and ``test_pipeline_gate.py`` each read the results of their gate at world sizes 2, 4 and
8. When the session holds tests of both files, the first to ask for a world size starts one launch that runs gate.py's
layouts and then the pipeline ones in the same ranks (``pipeline_gate.py --with-gate``), and the other file reads the
second JSON: one interpreter start, torch / transformers import and fork per world size instead of two. A session
with only one of the files launches only that gate, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_utils import run_script

HERE = Path(__file__).resolve().parent
# which gate each test file reads
TEST_FILES = {"gate": "test_parallel_gate.py", "pipeline": "test_pipeline_gate.py"}
_RESULTS: dict[tuple[int, str], dict] = {}  # (world size, "gate" | "pipeline") -> the gate's JSON
_FAILED: dict[tuple[int, str], str] = {}  # (world size, gate) -> the launch's output, where its JSON is missing


def _wanted(session: pytest.Session) -> set[str]:
    names = {Path(str(item.fspath)).name for item in session.items}
    return {kind for kind, name in TEST_FILES.items() if name in names}


def results(kind: str, world: int, request: pytest.FixtureRequest, tmp_path_factory) -> dict:
    """The JSON that gate ``kind`` ("gate" or "pipeline") wrote at ``world`` ranks, launching once per world size."""
    key = (world, kind)
    if key not in _RESULTS and key not in _FAILED:
        kinds = sorted(_wanted(request.session) | {kind})
        folder = tmp_path_factory.mktemp(f"gates{world}")
        out = {k: folder / f"{k}{world}.json" for k in kinds}
        if kinds == ["gate"]:
            args = [HERE / "gate.py", "--world-size", str(world), "--out", str(out["gate"]), "--timeout", "60"]
        else:  # the pipeline gate's launch, running gate.py's layouts first where the session has their tests
            args = [HERE / "pipeline_gate.py", "--world-size", str(world), "--out", str(out["pipeline"])]
            args += ["--timeout", "120", *(["--with-gate", str(out["gate"])] if "gate" in out else [])]
        proc = run_script(*args, timeout={"gate": 420, "pipeline": 480}.get("".join(kinds), 900))
        last = "pipeline" if "pipeline" in out else "gate"
        for k, path in out.items():
            # A JSON is written once all of its gate's layouts ran: a launch that failed in the pipeline layouts
            # still holds gate.py's complete results. The gate that ran last needs the launch to end cleanly too.
            if path.is_file() and (proc.returncode == 0 or k != last):
                _RESULTS[(world, k)] = json.loads(path.read_text())
            else:
                _FAILED[(world, k)] = f"rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    if key in _FAILED:
        pytest.fail(f"{kind} gate worker failed at world size {world}:\n{_FAILED[key]}")
    return _RESULTS[key]
