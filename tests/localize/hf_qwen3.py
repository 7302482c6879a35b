"""The documented transformers example (docs/parallelizing_your_own_module.md, "A complete `transformers` example":
Qwen3ForCausalLM from a tiny float64 config, its tp plan) as a ``--module`` file of ``python -m titanlike.localize``;
``QK_NORM`` set by the trap file below it replaces the plan of q_norm / k_norm."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))

import torch.nn.functional as F  # noqa: E402
from traps_worker import documented_example  # noqa: E402

from titanlike.parallel import apply_tp  # noqa: E402

MESH = {"tp": 2}
EXAMPLE = documented_example()
QK_NORM = None  # a style for q_norm / k_norm instead of the example's


def build():
    return EXAMPLE.build()


def parallelize(model, mesh):
    plan = EXAMPLE.tp_plan(model)
    if QK_NORM is not None:
        plan = {k: QK_NORM() if k.endswith(("q_norm", "k_norm")) else v for k, v in plan.items()}
    return apply_tp(model, mesh["tp"], plan)


def batch(step: int):
    return EXAMPLE.batch(step)


def loss(output, labels):
    from torch.distributed.tensor import DTensor

    if isinstance(output.logits, DTensor):  # the parallel model: vocab-parallel logits
        return EXAMPLE.sum_cross_entropy(output, labels) / labels.numel()
    return F.cross_entropy(output.logits.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
