"""Qwen3-MoE's Hugging Face adapter (:class:`titanlike.hf.HFAdapter`) for ``Qwen3MoeForCausalLM``.

Names: Qwen3's (``titanlike.models.qwen3.hf``: attention, norms, embeddings, head, a dense layer's ``mlp``) plus, in
a MoE layer (N = block index, e = expert)::

    layers.N.moe.router.gate.weight   model.layers.N.mlp.gate.weight
    layers.N.moe.experts.w1[e]        model.layers.N.mlp.experts.e.gate_proj.weight   (as Qwen ship them)
    layers.N.moe.experts.w3[e]        model.layers.N.mlp.experts.e.up_proj.weight
    layers.N.moe.experts.w2[e]        model.layers.N.mlp.experts.e.down_proj.weight

Import stacks the per-expert tensors, or takes transformers 5's fused in-memory form (``mlp.experts.gate_up_proj``
``(E, 2 I, H)`` = ``w1`` then ``w3`` on dim 1, ``mlp.experts.down_proj`` ``(E, H, I)`` = ``w2``); export writes the
per-expert form, which every transformers version loads. Hugging Face's model has no expert bias: import starts
the bias at zero, export refuses a non-zero one (it changes which experts a token picks, so the exported model would
compute something else).

config.json: Qwen3's fields, and ``moe_intermediate_size``, ``num_experts`` (transformers 5.24: ``num_local_experts``),
``num_experts_per_tok``, ``norm_topk_prob``, ``decoder_sparse_step`` (1 only) and ``mlp_only_layers`` (the first k
layers only: ``n_dense_layers``); ``router_aux_loss_coef`` and ``output_router_logits`` configure Hugging Face's
training loss, not what the weights compute, and are set aside. An imported model has no expert bias
(``load_balance_coeff`` None, as Hugging Face's: so it exports again) and no sequence-wise aux loss.
"""

from __future__ import annotations

import re

import torch

from titanlike.models.hf_common import Experts, check_same_fields, describe_fields
from titanlike.models.qwen3 import hf as qwen3_hf
from titanlike.models.qwen3_moe.model import Qwen3MoeArgs

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"

_OURS_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w1|w2|w3)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_ROUTER = re.compile(r"layers\.(\d+)\.moe\.router\.gate\.weight")
_HF_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")
_BIAS = re.compile(r"layers\.(\d+)\.moe\.expert_bias")
_MOE_FIELDS = {
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
    "output_router_logits",
}
ARCH_FIELDS = (*qwen3_hf.ARCH_FIELDS, "moe_hidden_dim", "num_experts", "top_k", "route_norm", "n_dense_layers")


def hf_name(fqn: str) -> str:
    m = _OURS_EXPERTS.fullmatch(fqn)
    if m:
        return Experts.hf_name(f"model.layers.{m.group(1)}", m.group(2))
    m = _ROUTER.fullmatch(fqn)
    if m:
        return f"model.layers.{m.group(1)}.mlp.gate.weight"
    if _BIAS.fullmatch(fqn):
        return f"{fqn} (titanlike's expert bias; Hugging Face's Qwen3-MoE has none)"
    return qwen3_hf.hf_name(fqn)


def to_hf(state_dict: dict[str, torch.Tensor], args: Qwen3MoeArgs) -> dict[str, torch.Tensor]:
    """Our full (plain-tensor) state dict -> Hugging Face names, every expert apart; new contiguous tensors."""
    out = {}
    for fqn, t in state_dict.items():
        if _BIAS.fullmatch(fqn):
            if t.abs().max() > 0:
                raise ValueError(
                    f"{fqn} is not zero (max |bias| {t.abs().max().item():.3g}): Qwen3MoeForCausalLM has no expert "
                    f"bias, so the exported model would route tokens to other experts; train with "
                    f"load_balance_coeff None to export to Hugging Face"
                )
            continue
        m = _OURS_EXPERTS.fullmatch(fqn)
        if m:
            out.update(Experts.to_hf(f"model.layers.{m.group(1)}", m.group(2), t))
            continue
        m = _ROUTER.fullmatch(fqn)
        if m:
            out[f"model.layers.{m.group(1)}.mlp.gate.weight"] = t.detach().clone().contiguous()
            continue
        if fqn == "output.weight" and args.tie_embeddings:
            continue
        out[qwen3_hf.hf_name(fqn)] = t.detach().clone().contiguous()
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Qwen3MoeArgs) -> dict[str, torch.Tensor]:
    """A Hugging Face Qwen3-MoE state dict (per-expert or fused experts) -> our FQNs, the experts stacked, every
    expert bias zero; whether it is exactly the model's state dict is the caller's check."""
    rest, experts, out = {}, Experts(), {}
    for name, t in hf_state_dict.items():
        m = _HF_LAYER.fullmatch(name)
        if m and experts.take(m.group(2), t, f"layers.{m.group(1)}", out):
            continue
        m = _HF_ROUTER.fullmatch(name)
        if m:
            out[f"layers.{m.group(1)}.moe.router.gate.weight"] = t
            continue
        rest[name] = t
    experts.stack_into(out)
    out.update(qwen3_hf.from_hf(rest, args))
    if args.load_balance_coeff is not None:
        for i in range(args.n_dense_layers, args.n_layers):
            out[f"layers.{i}.moe.expert_bias"] = torch.zeros(args.num_experts, dtype=torch.float32)
    return out


def export_violations(args: Qwen3MoeArgs) -> list[str]:
    """Why a model of ``args`` cannot be exported to ``Qwen3MoeForCausalLM`` (checked before training starts)."""
    if args.load_balance_coeff is not None:
        return [
            "checkpoint.export_safetensors: Qwen3MoeForCausalLM has no expert bias, and this model trains one "
            f"(load_balance_coeff {args.load_balance_coeff}: it changes which experts a token picks); export a model "
            "imported from Hugging Face (no bias), or turn export_safetensors off"
        ]
    if args.score_func != "softmax" or args.num_shared_experts or args.num_groups > 1 or args.route_scale != 1.0:
        return [
            "checkpoint.export_safetensors: Qwen3MoeForCausalLM routes by softmax top-k with no shared experts, "
            "groups or route scale, and this model's routing differs; turn export_safetensors off"
        ]
    return []


def shape_hint(fqn: str, got: tuple, want: tuple) -> str:
    return ""


def hf_config(args: Qwen3MoeArgs, dtype: torch.dtype, bos_id: int | None, eos_id: int | None, layout: int) -> dict:
    """A ``Qwen3MoeForCausalLM`` config.json: Qwen3's fields, and the experts'."""
    config = qwen3_hf.hf_config(args, dtype, bos_id, eos_id, layout)
    config.update(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        intermediate_size=args.ffn_hidden_dim,
        moe_intermediate_size=args.moe_hidden_dim,
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=args.route_norm,
        decoder_sparse_step=1,
        mlp_only_layers=list(range(args.n_dense_layers)),
        router_aux_loss_coef=0.0,
        output_router_logits=False,
    )
    return config


def model_args_from_hf_config(config: dict) -> Qwen3MoeArgs:
    """Qwen3MoeArgs of a Hugging Face Qwen3-MoE config.json; ValueError naming every field titanlike cannot honour,
    in one line."""
    problems: list[str] = []
    base = None
    try:
        base = qwen3_hf.model_args_from_hf_config({k: v for k, v in config.items() if k not in _MOE_FIELDS})
    except ValueError as e:
        problems.append(str(e))
    experts = config.get("num_experts", config.get("num_local_experts"))
    for key, value in (("moe_intermediate_size", config.get("moe_intermediate_size")), ("num_experts", experts)):
        if value is None:
            problems.append(f"lacks {key}")
    if config.get("decoder_sparse_step", 1) != 1:
        problems.append(
            f"decoder_sparse_step = {config['decoder_sparse_step']!r} (titanlike's MoE layers are every layer "
            f"after the first n_dense_layers)"
        )
    dense = list(config.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        problems.append(f"mlp_only_layers = {dense!r} (titanlike's dense layers are the first k: [0, ..., k-1])")
    if problems:
        raise ValueError("; ".join(problems))
    args = Qwen3MoeArgs(
        **{f: getattr(base, f) for f in base.__dataclass_fields__},
        moe_hidden_dim=int(config["moe_intermediate_size"]),
        num_experts=int(experts),
        top_k=int(config.get("num_experts_per_tok", 8)),
        route_norm=bool(config.get("norm_topk_prob", False)),
        n_dense_layers=len(dense),
        load_balance_coeff=None,  # Hugging Face's Qwen3-MoE has no expert bias
        aux_loss_coeff=0.0,
    )
    args.moe_args()  # the block's own checks (top_k above the experts, ...): ValueError
    return args


def describe(args: Qwen3MoeArgs) -> str:
    """The architecture fields import takes from config.json, as one line."""
    return describe_fields(args, (*ARCH_FIELDS, "max_seq_len"))


def check_same_architecture(args: Qwen3MoeArgs, ours: Qwen3MoeArgs, source: str) -> None:
    """ValueError when weights made for ``args`` would not mean the same in a model of ``ours``."""
    check_same_fields(args, ours, source, ARCH_FIELDS)
