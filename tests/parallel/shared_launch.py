"""Two launches per world size for the gloo workers of tests/parallel that run a rank function and write one JSON.

    python tests/parallel/shared_launch.py --world-size 2 --run gate=g.json --run probes=p.json --run traps=t.json

Each ``--run KIND=OUT`` is a worker's rank function (:data:`KINDS`) run in the same forked ranks, one after the
other, writing its JSON as its own launch would: the equality gates (gate.py, pipeline_gate.py), the 2-rank probes
(tp_probe_worker.py), expert parallelism (moe_ep_worker.py), the vocab-parallel loss (loss_parallel_worker.py), AC
under tp / FSDP (ac_parallel_worker.py), the sharded init (tests/init/init_worker.py), the README's example
(tests/examples/nanogpt_example_worker.py), the traps (traps_worker.py), generation under tp
(tests/generate/generate_worker.py) and layout-invariant training (invariant_worker.py). One interpreter start, torch /
transformers import, fork and process group per launch instead of one per worker and world size.

The tests read the results through :func:`results`: the first test that asks for a kind at a world size starts the
launch of its group (:data:`GROUPS`) with every kind of the group and world size whose test file is in the session
(a session with one file launches only its worker, as that worker's own script would). Each JSON is written once all
of its worker's work ran, so a launch that fails in a later worker still gives the earlier ones their complete
results; the tests of a worker without its JSON fail with the launch's output.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent

# kind -> (worker module, rank function, its arguments after (rank, world_size) given the JSON path, test file,
# world sizes); the worker modules of tests/init and tests/examples are found through WORKER_DIRS
KINDS = {
    "gate": ("gate", "gate_main", lambda out: (out, None), "test_parallel_gate.py", (2, 4, 8)),
    "pipeline": ("pipeline_gate", "gate_main", lambda out: (out, None), "test_pipeline_gate.py", (2, 4, 8)),
    "probes": ("tp_probe_worker", "main_probe", lambda out: (out,), "test_parallel_probes.py", (2,)),
    "ep": ("moe_ep_worker", "worker", lambda out: (out, None), "test_expert_parallel.py", (2, 4)),
    "loss": ("loss_parallel_worker", "rank_main", lambda out: (out,), "test_loss_parallel.py", (2, 4)),
    "ac": ("ac_parallel_worker", "worker", lambda out: (out,), "test_activation_checkpoint.py", (2,)),
    "init": ("init_worker", "main", lambda out: (out,), "test_init.py", (4,)),
    "nanogpt": (
        "nanogpt_example_worker",
        "rank_main",
        lambda out: (out, f"{out}.ckpt"),
        "test_nanogpt_example.py",
        (8,),
    ),
    "traps": ("traps_worker", "rank_main", lambda out: (out,), "test_traps.py", (2,)),
    "generate": ("generate_worker", "rank_main", lambda out: (out,), "test_generate.py", (2,)),
    "invariant": ("invariant_worker", "rank_main", lambda out: (out,), "test_layout_invariance.py", (2, 4)),
}
WORKER_DIRS = (HERE.parent / "init", HERE.parent / "examples", HERE.parent / "generate")
# The launches of a world size: the pipeline gate alone, gate.py's layouts first in the other (so that nothing
# another worker leaves in the ranks can touch their results). The two gates in the same ranks were measured slower
# than apart (at 4 ranks the pipeline layouts after gate.py's took 77 s against 51 s alone); the small workers after
# gate.py's layouts ran as fast as alone.
GROUPS = (("pipeline",), ("gate", *(k for k in KINDS if k not in ("gate", "pipeline"))))
# per kind: the launch's time limit alone (seconds) and the gloo timeout it needs
TIMEOUT_S = {"gate": 420, "pipeline": 480, "probes": 300, "ep": 420, "loss": 120, "ac": 240, "init": 240}
TIMEOUT_S |= {"nanogpt": 400, "traps": 400, "generate": 120, "invariant": 240}
GLOO_TIMEOUT_S = {"gate": 60, "pipeline": 120, "probes": 60, "ep": 60, "loss": 30, "ac": 60, "init": 120}
GLOO_TIMEOUT_S |= {"nanogpt": 120, "traps": 120, "generate": 60, "invariant": 60}


def _run_all(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> None:
    for kind, out in jobs:
        module, fn, args, _, _ = KINDS[kind]
        t0 = time.perf_counter()
        getattr(importlib.import_module(module), fn)(rank, world_size, *args(out))
        if rank == 0:
            print(f"[shared ws={world_size}] {kind} in {time.perf_counter() - t0:.1f} s", flush=True)


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
    sys.path[1:1] = [str(d) for d in WORKER_DIRS if str(d) not in sys.path]
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

    key = (world, kind)
    if key not in _RESULTS and key not in _FAILED:
        files = {Path(str(item.fspath)).name for item in request.session.items}
        group = next(g for g in GROUPS if kind in g)
        kinds = [k for k in group if world in KINDS[k][4] and (k == kind or KINDS[k][3] in files)]
        for attempt in (1, 2):
            proc = _launch(world, kinds, tmp_path_factory)
            killed = _killed_from_outside(proc.stderr)
            kinds = [k for k in kinds if (world, k) not in _RESULTS]
            if attempt == 2 or not (kinds and killed):
                break
            # Once: a rank the launch did not kill died of a signal (no Python error of its own; a machine's OOM killer,
            # a crash inside gloo). What that layout computes is deterministic: a wrong one fails again.
            warnings.warn(f"the launch of {kinds} at world size {world} lost {killed}: launched again", stacklevel=1)
        for k in kinds:
            _FAILED[(world, k)] = f"rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    if key in _FAILED:
        pytest.fail(f"the {kind} worker failed at world size {world}:\n{_FAILED[key]}")
    return _RESULTS[key]


def _launch(world: int, kinds: list[str], tmp_path_factory):
    """One launch of ``kinds`` at ``world`` ranks; the results of those whose JSON it wrote go into _RESULTS."""
    from dist_utils import run_script

    folder = tmp_path_factory.mktemp(f"shared{world}")
    out = {k: folder / f"{k}{world}.json" for k in kinds}
    runs = [arg for k in kinds for arg in ("--run", f"{k}={out[k]}")]
    limit = sum(TIMEOUT_S[k] for k in kinds)
    try:
        proc = run_script(HERE / "shared_launch.py", "--world-size", str(world), *runs, timeout=limit)
    except subprocess.TimeoutExpired as e:  # a failure like any other: recorded once, never launched again
        err = f"{e.stderr or ''}\nthe launch timed out after {limit} s"
        proc = subprocess.CompletedProcess(e.cmd, -1, e.stdout or "", err)
    for k, path in out.items():
        if path.is_file() and (proc.returncode == 0 or k != kinds[-1]):  # the last worker needs a clean end too
            _RESULTS[(world, k)] = json.loads(path.read_text())
    return proc


def _killed_from_outside(stderr: str) -> str:
    """The ranks of a failed launch that a signal ended without spawn's doing ("rank 2: -9 (SIGKILL)", from
    dist_utils.spawn's last line), or ''."""
    return ", ".join(re.findall(r"rank \d+: -\d+ \(SIG\w+\)", stderr.rpartition("=== spawn:")[2]))


if __name__ == "__main__":
    sys.exit(main())
