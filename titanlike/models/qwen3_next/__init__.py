"""Qwen3-Next (Gated DeltaNet + gated attention hybrid, MoE with a gated shared expert) and its model spec."""

from titanlike.models.qwen3_next.activations import attention_activations
from titanlike.models.qwen3_next.hf import export_violations
from titanlike.models.qwen3_next.model import FLAVORS, Qwen3Next, Qwen3NextArgs, Qwen3NextBlock, param_init
from titanlike.models.qwen3_next.sharding import SHARDING, sharding_of
from titanlike.models.spec import ModelSpec, register

__all__ = ["FLAVORS", "SPEC", "Qwen3Next", "Qwen3NextArgs", "Qwen3NextBlock", "param_init"]


def _shape_violations(args) -> list[str]:
    out = []
    if args.rotary_dim % 2 or args.rotary_dim < 2:
        out.append(
            f"model: head_dim {args.head_dim} x partial_rotary_factor {args.partial_rotary_factor} must give an "
            f"even number of rotated dims"
        )
    if args.linear_v_heads % args.linear_k_heads:
        out.append(
            f"model: linear_v_heads {args.linear_v_heads} must be a multiple of linear_k_heads {args.linear_k_heads}"
        )
    if args.full_attention_interval < 1:
        out.append(f"model: full_attention_interval {args.full_attention_interval} must be >= 1")
    if args.conv_kernel < 1 or args.linear_chunk_size < 1:
        out.append(f"model: conv_kernel {args.conv_kernel} and linear_chunk_size {args.linear_chunk_size} must be >= 1")
    if args.num_experts:
        try:
            args.moe_args()
        except ValueError as e:
            out.append(f"model: {e}")
    return out


def _tp_violations(args, tp: int) -> list[str]:
    if args.linear_k_heads % tp:
        return [
            f"parallelism.tensor_parallel_degree {tp} does not divide the Gated DeltaNet key heads "
            f"{args.linear_k_heads} (each tp rank holds whole key-head groups); choose a tp degree dividing "
            f"{args.linear_k_heads}"
        ]
    return []


def _linear_attention(args, layer_id: int):
    if args.layer_type(layer_id) != "linear_attention":
        return None
    channels = 2 * args.key_dim + args.value_dim
    return args.linear_v_heads, args.linear_k_head_dim, args.linear_v_head_dim, channels, args.conv_kernel


def _num_experts(args) -> int:
    return args.num_experts


SPEC = register(
    ModelSpec(
        name="qwen3_next",
        model_cls=Qwen3Next,
        args_cls=Qwen3NextArgs,
        flavors=FLAVORS,
        sharding=SHARDING,
        sharding_fn=sharding_of,  # a dense SwiGLU's entries instead of the MoE block's without experts
        context_parallel=True,  # attention, the linear-attention seams and positions through the shared seams
        shape_violations=_shape_violations,
        tp_violations=_tp_violations,
        linear_attention=_linear_attention,
        attention_activations=attention_activations,
        norm_kind="rms_zero_centred",  # ZeroCentredRMSNorm: x (1 + w) in float32
        num_experts=_num_experts,
        hf_adapter="titanlike.models.qwen3_next.hf",
        hf_export_violations=export_violations,
    )
)
