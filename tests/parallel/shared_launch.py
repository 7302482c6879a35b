"""One launch per world size for the gloo workers of tests/parallel that run a rank function and write one JSON.

    python tests/parallel/shared_launch.py --world-size 2 --run gate=g.json --run pipeline=p.json --run traps=t.json

Each ``--run KIND=OUT`` (in :data:`ORDER`) is a worker's rank function (:data:`KINDS`) run in the same forked ranks
one after the other, writing its JSON as its own launch would: the equality gates (gate.py, pipeline_gate.py), the
2-rank probes (tp_probe_worker.py), expert parallelism (moe_ep_worker.py) and the traps (traps_worker.py). One
interpreter start, torch / transformers import, fork and process group per world size instead of one per worker.

The tests read the results through :func:`results`: the first test that asks for a world size starts one launch with
every kind of that world size whose test file is in the session (a session with one file launches only its worker,
as that worker's own script would). Each JSON is written once all of its worker's work ran, so a launch that fails
in a later worker still gives the earlier ones their complete results; the tests of a worker without its JSON fail
with the launch's output.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# kind -> (worker module, rank function, extra arguments after (rank, world_size, out), test file, world sizes)
KINDS = {
    "gate": ("gate", "gate_main", (None,), "test_parallel_gate.py", (2, 4, 8)),
    "pipeline": ("pipeline_gate", "gate_main", (None,), "test_pipeline_gate.py", (2, 4, 8)),
    "probes": ("tp_probe_worker", "main_probe", (), "test_parallel_probes.py", (2,)),
    "ep": ("moe_ep_worker", "worker", (None,), "test_expert_parallel.py", (2, 4)),
    "traps": ("traps_worker", "rank_main", (), "test_traps.py", (2,)),
}
ORDER = list(KINDS)  # the gates first: nothing another worker leaves in the ranks can touch their results
# per kind: the launch's time limit alone (seconds) and the gloo timeout it needs
TIMEOUT_S = {"gate": 420, "pipeline": 480, "probes": 300, "ep": 420, "traps": 400}
GLOO_TIMEOUT_S = {"gate": 60, "pipeline": 120, "probes": 60, "ep": 60, "traps": 120}


def _run_all(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> None:
    for kind, out in jobs:
        module, fn, extra, _, _ = KINDS[kind]
        getattr(importlib.import_module(module), fn)(rank, world_size, out, *extra)


def main(argv: list[str] | None = None) -> int:
    from dist_utils import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--run", action="append", required=True, help="KIND=OUT_JSON (repeatable, run in that order)")
    a = ap.parse_args(argv)
    jobs = [(kind, out) for kind, _, out in (r.partition("=") for r in a.run)]
    unknown = [k for k, _ in jobs if k not in KINDS or a.world_size not in KINDS[k][4]]
    if unknown:
        ap.error(f"no such worker at world size {a.world_size}: {unknown}")
    # Before the fork, once for every rank: each worker's imports, the transformers models the gates and traps build.
    import gate

    layouts = []
    for kind, _ in jobs:
        module = importlib.import_module(KINDS[kind][0])
        if kind in ("gate", "pipeline"):
            layouts += module.LAYOUTS
        if hasattr(module, "prepare"):
            module.prepare()
    gate.warm_hf_models(layouts, a.world_size, None)
    timeout = max(GLOO_TIMEOUT_S[k] for k, _ in jobs)
    return spawn(_run_all, a.world_size, jobs, timeout_s=timeout)


# ---------------------------------------------------------------------------------------------- for the tests
_RESULTS: dict[tuple[int, str], object] = {}  # (world size, kind) -> the worker's JSON
_FAILED: dict[tuple[int, str], str] = {}  # (world size, kind) -> the launch's output, where its JSON is missing


def results(kind: str, world: int, request, tmp_path_factory):
    """The JSON that worker ``kind`` wrote at ``world`` ranks; the first call for a world size launches every kind of
    that world size whose test file the session holds (``kind`` always)."""
    import pytest
    from dist_utils import run_script

    key = (world, kind)
    if key not in _RESULTS and key not in _FAILED:
        files = {Path(str(item.fspath)).name for item in request.session.items}
        kinds = [k for k in ORDER if world in KINDS[k][4] and (k == kind or KINDS[k][3] in files)]
        folder = tmp_path_factory.mktemp(f"shared{world}")
        out = {k: folder / f"{k}{world}.json" for k in kinds}
        runs = [arg for k in kinds for arg in ("--run", f"{k}={out[k]}")]
        proc = run_script(
            HERE / "shared_launch.py", "--world-size", str(world), *runs, timeout=sum(TIMEOUT_S[k] for k in kinds)
        )
        for k, path in out.items():
            # the worker that ran last needs the launch to end cleanly too
            if path.is_file() and (proc.returncode == 0 or k != kinds[-1]):
                _RESULTS[(world, k)] = json.loads(path.read_text())
            else:
                _FAILED[(world, k)] = f"rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    if key in _FAILED:
        pytest.fail(f"the {kind} worker failed at world size {world}:\n{_FAILED[key]}")
    return _RESULTS[key]


if __name__ == "__main__":
    sys.exit(main())
