"""Qwen3-MoE (Qwen3 attention, every layer a mixture of experts; DeepSeek-V3 routing options) and its model spec."""

from titanlike.models.qwen3_moe.hf import export_violations
from titanlike.models.qwen3_moe.model import FLAVORS, Qwen3Moe, Qwen3MoeArgs, Qwen3MoeBlock, param_init
from titanlike.models.qwen3_moe.sharding import SHARDING
from titanlike.models.spec import ModelSpec, register

__all__ = ["FLAVORS", "SPEC", "Qwen3Moe", "Qwen3MoeArgs", "Qwen3MoeBlock", "param_init"]


def _shape_violations(args) -> list[str]:
    out = [f"model: head_dim {args.head_dim} must be even for RoPE"] if args.head_dim % 2 else []
    if not 0 <= args.n_dense_layers <= args.n_layers:
        out.append(f"model: n_dense_layers {args.n_dense_layers} must be between 0 and n_layers {args.n_layers}")
    try:
        args.moe_args()
    except ValueError as e:
        out.append(f"model: {e}")
    return out


def _num_experts(args) -> int:
    return args.num_experts if args.n_moe_layers else 0


SPEC = register(
    ModelSpec(
        name="qwen3_moe",
        model_cls=Qwen3Moe,
        args_cls=Qwen3MoeArgs,
        flavors=FLAVORS,
        sharding=SHARDING,
        context_parallel=True,
        shape_violations=_shape_violations,
        num_experts=_num_experts,
        hf_adapter="titanlike.models.qwen3_moe.hf",
        hf_export_violations=export_violations,
    )
)
