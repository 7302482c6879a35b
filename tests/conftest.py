"""Test-support import paths, set once for the whole suite (no per-file ``sys.path`` edits).

* ``tests/`` holds ``dist_utils`` (forked gloo ranks, worker launches);
* ``tests/parallel/`` holds the equality gates (``gate``, ``pipeline_gate``), imported by their tests;
* ``tests/fault/`` holds ``fault_model`` (a dropout model for the bitwise-RNG fault tests);
* ``scripts/`` holds the command-line tools that tests drive in-process (``plan``, ``ac_memory``, ...);
* ``examples/`` holds the README's complete example (``nanogpt_parallel``), whose module the pipeline gate reuses.

Worker scripts run in a subprocess get the same paths through ``dist_utils.worker_env()``; their own folder is on
their path anyway (``python tests/x/worker.py``).
"""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
for path in (REPO / "scripts", REPO / "examples", TESTS / "parallel", TESTS / "fault", TESTS, REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
