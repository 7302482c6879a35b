"""Qwen3 (dense: GQA with QK-norm, no biases, RoPE theta 1e6, SwiGLU, explicit head_dim) and its model spec."""

from titanlike.models.layers import RMSNorm
from titanlike.models.qwen3.model import FLAVORS, Attention, Qwen3, Qwen3Args, Qwen3Block, apply_rope_half, param_init
from titanlike.models.qwen3.sharding import SHARDING
from titanlike.models.spec import ModelSpec, register

__all__ = ["FLAVORS", "SPEC", "Attention", "Qwen3", "Qwen3Args", "Qwen3Block", "apply_rope_half", "param_init"]


def _shape_violations(args) -> list[str]:
    return [f"model: head_dim {args.head_dim} must be even for RoPE"] if args.head_dim % 2 else []


SPEC = register(
    ModelSpec(
        name="qwen3",
        model_cls=Qwen3,
        args_cls=Qwen3Args,
        flavors=FLAVORS,
        sharding=SHARDING,
        context_parallel=True,
        te_norm=RMSNorm,
        shape_violations=_shape_violations,
        hf_adapter="titanlike.models.qwen3.hf",
    )
)
