"""tests/localize/user_decoder.py with the attention output projection planned column-wise instead of row-wise."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from torch.distributed.tensor.parallel import ColwiseParallel  # noqa: E402
from user_decoder import MESH, batch, block_plan, build, parallelize_with  # noqa: E402, F401


def parallelize(model, mesh):
    return parallelize_with(model, mesh, block_plan(o_proj=ColwiseParallel()))
