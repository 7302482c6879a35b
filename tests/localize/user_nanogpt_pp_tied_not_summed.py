"""tests/localize/user_nanogpt_pp.py with the pipeline gate's ``pp_tied_not_summed`` planted on the parallel side
(the first and the last stage keep their own gradient of the tied weight)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from user_nanogpt_pp import MESH, batch, build  # noqa: E402, F401
from user_nanogpt_pp import parallelize as right  # noqa: E402

_PLANTED = contextlib.ExitStack()  # open until the process ends: the reference has run, the layout's steps follow


def parallelize(model, mesh):
    import gate
    import pipeline_gate  # noqa: F401 - registers the pipeline mutations in gate.MUTATIONS

    pp = right(model, mesh)
    _PLANTED.enter_context(gate.MUTATIONS["pp_tied_not_summed"]())
    return pp
