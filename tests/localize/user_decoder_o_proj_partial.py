"""tests/localize/user_decoder.py with o_proj row-wise but "local" (transformers' local_rowwise: the all-reduce left
to a parent module's gather, which this plan forgot): each tp rank keeps its partial sum of the projection."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from torch.distributed.tensor import Partial  # noqa: E402
from torch.distributed.tensor.parallel import RowwiseParallel  # noqa: E402
from user_decoder import MESH, batch, block_plan, build, parallelize_with  # noqa: E402, F401


def parallelize(model, mesh):
    return parallelize_with(model, mesh, block_plan(o_proj=RowwiseParallel(output_layouts=Partial())))
