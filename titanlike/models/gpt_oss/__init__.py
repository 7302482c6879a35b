"""gpt-oss (GQA with biases, alternating sliding-window / full attention with per-head sinks, YaRN RoPE, a biased
top-k MoE with clamped experts) and its model spec."""

from titanlike.models.gpt_oss.hf import export_violations
from titanlike.models.gpt_oss.model import FLAVORS, LAYER_TYPES, GptOss, GptOssArgs, GptOssBlock, Sinks, param_init
from titanlike.models.gpt_oss.sharding import SHARDING, sharding_of
from titanlike.models.layers import RMSNorm
from titanlike.models.spec import ModelSpec, register

__all__ = ["FLAVORS", "SPEC", "GptOss", "GptOssArgs", "GptOssBlock", "Sinks", "param_init"]


def _shape_violations(args) -> list[str]:
    out = [f"model: head_dim {args.head_dim} must be even for RoPE"] if args.head_dim % 2 else []
    if args.sliding_window < 1:
        out.append(f"model.sliding_window {args.sliding_window} must be >= 1")
    bad = [t for t in args.layer_types if t not in LAYER_TYPES]
    if bad or (args.layer_types and len(args.layer_types) != args.n_layers):
        out.append(
            f"model: layer_types {list(args.layer_types)} must name one of {', '.join(LAYER_TYPES)} for each of the "
            f"{args.n_layers} layers"
        )
    try:
        args.moe_args()
    except ValueError as e:
        out.append(f"model: {e}")
    return out


SPEC = register(
    ModelSpec(
        name="gpt_oss",
        model_cls=GptOss,
        args_cls=GptOssArgs,
        flavors=FLAVORS,
        sharding=SHARDING,
        sharding_fn=sharding_of,
        context_parallel=True,
        te_norm=RMSNorm,
        shape_violations=_shape_violations,
        num_experts=lambda args: args.num_experts,
        hf_adapter="titanlike.models.gpt_oss.hf",
        hf_export_violations=export_violations,
    )
)
