"""DeepSeek-V3 (multi-head latent attention, DeepSeek MoE routing, multi-token prediction) and its model spec."""

from titanlike.models.deepseek_v3.activations import attention_activations
from titanlike.models.deepseek_v3.model import (
    FLAVORS,
    MLA,
    DeepseekV3,
    DeepseekV3Args,
    DeepseekV3Block,
    MTPModule,
    param_init,
)
from titanlike.models.deepseek_v3.sharding import SHARDING, sharding_for
from titanlike.models.layers import RMSNorm
from titanlike.models.spec import ModelSpec, register

__all__ = ["FLAVORS", "MLA", "SPEC", "DeepseekV3", "DeepseekV3Args", "DeepseekV3Block", "MTPModule", "param_init"]


def _shape_violations(args: DeepseekV3Args) -> list[str]:
    out = []
    if args.qk_rope_head_dim < 2 or args.qk_rope_head_dim % 2:
        out.append(f"model: qk_rope_head_dim {args.qk_rope_head_dim} must be even and >= 2 for RoPE")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        if getattr(args, name) < 1:
            out.append(f"model: {name} must be >= 1, got {getattr(args, name)}")
    if args.q_lora_rank < 0:
        out.append(f"model: q_lora_rank must be >= 0 (0: a plain query projection), got {args.q_lora_rank}")
    if args.rope_scaling not in ("none", "yarn"):
        out.append(f"model: rope_scaling {args.rope_scaling!r} is not 'none' or 'yarn'")
    if not 0 <= args.n_dense_layers <= args.n_layers:
        out.append(f"model: n_dense_layers {args.n_dense_layers} must be between 0 and n_layers {args.n_layers}")
    if args.mtp_layers < 0:
        out.append(f"model: mtp_layers must be >= 0, got {args.mtp_layers}")
    if args.num_experts > 0 and (args.n_moe_layers or args.mtp_layers):
        try:
            args.moe_args()
        except ValueError as e:
            out.append(f"model: {e}")
    return out


def _prediction_blocks(args: DeepseekV3Args) -> dict[str, int]:
    return {f"mtp.{k}.block": args.n_layers + k - 1 for k in range(1, args.mtp_layers + 1)}


def _num_experts(args: DeepseekV3Args) -> int:
    return args.num_experts if args.n_moe_layers or (args.mtp_layers and args.num_experts) else 0


SPEC = register(
    ModelSpec(
        name="deepseek_v3",
        model_cls=DeepseekV3,
        args_cls=DeepseekV3Args,
        flavors=FLAVORS,
        sharding=SHARDING,
        sharding_fn=sharding_for,
        context_parallel=True,
        te_norm=RMSNorm,
        shape_violations=_shape_violations,
        num_experts=_num_experts,
        attention_activations=attention_activations,
        prediction_blocks=_prediction_blocks,
        hf_adapter="titanlike.models.deepseek_v3.hf",
    )
)
