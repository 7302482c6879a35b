"""Issue 26's silent trap reproduced by hand: Qwen3's per-head q_norm / k_norm planned ReplicateParallel with its
replica check off (``check="never"``): each tp rank's weight gradient covers only its own heads, never summed."""

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_qwen3  # noqa: E402
from hf_qwen3 import MESH, batch, build, loss, parallelize  # noqa: E402, F401

from titanlike.parallel import ReplicateParallel  # noqa: E402

hf_qwen3.QK_NORM = partial(ReplicateParallel, check="never")
