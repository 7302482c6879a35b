"""The sharding of a transformers model, translated from the plan its config declares (``base_model_tp_plan``) into
``titanlike.sharding`` entries, string by string; what the plan leaves out (the norms on the residual stream, the
attention / MLP regions, the embedding and the head) is derived from the module tree. Patterns are the wrapper's
(``layers.*.self_attn.q_proj``: the base model's ``layers.*`` are the wrapper's).

==================================  ====================================================================================
``colwise``                          :class:`~titanlike.sharding.Colwise`
``rowwise``, ``rowwise_split_input`` :class:`~titanlike.sharding.Rowwise` (after a fused projection each rank's input
                                     is its own slice of every chunk, which is what Rowwise takes)
``colwise_gather_output`` on a       :class:`~titanlike.sharding.FusedColwise`: ``qkv_proj`` with chunks
fused projection                     ``(n_heads, n_kv_heads, n_kv_heads)`` (whole heads), ``gate_up_proj`` with 2
``replicated_with_grad_allreduce``   :class:`~titanlike.sharding.HeadNorm` on a per-head norm (its weight has
                                     ``head_dim`` elements: q/k norms), refused on anything else
``sequence_parallel``                :class:`~titanlike.sharding.Norm`
(not in the plan)                    ``embed_tokens``: VocabEmbedding; ``lm_head``: Head; the layers' and the final
                                     norms: Norm; the parents of the planned projections: Region (the stream enters as
                                     the ``hidden_states`` keyword argument, as transformers calls attention)
==================================  ====================================================================================

Any other plan string, a plan entry on a module the model has not, or a model without a plan (``base_model_tp_plan``
empty) is refused in one line naming it: never a silent replicate.
"""

from __future__ import annotations

import json

from torch import nn

from titanlike.models.transformers_lm.model import FUSED_GATE_UP, FUSED_QKV, HFArgs, meta_model
from titanlike.sharding import (
    Colwise,
    Entry,
    FusedColwise,
    Head,
    HeadNorm,
    Norm,
    Region,
    Rowwise,
    VocabEmbedding,
    matches,
)

__all__ = ["TranslationError", "sharding_for"]


class TranslationError(ValueError):
    """A plan string (or module) the translation cannot express exactly."""


def _norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and any(True for _ in module.parameters(recurse=False))


def _stream_keywords(model: nn.Module, regions: list[str]) -> dict[str, str | None]:
    """How each region module receives the residual stream, traced in one forward on the meta device: positionally
    (None) or as a keyword argument (its name; transformers calls attention with ``hidden_states=``)."""
    import torch

    seen: dict[str, str | None] = {}
    hooks = []
    for name in regions:

        def pre(module, args, kwargs, name=name):
            if not args:
                seen[name] = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
            else:
                seen.setdefault(name, None)

        hooks.append(model.get_submodule(name).register_forward_pre_hook(pre, with_kwargs=True))
    try:
        model(torch.zeros(1, 4, dtype=torch.long, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return seen


def translate(args: HFArgs, plan: dict[str, str], model: nn.Module) -> dict[str, Entry]:
    """``plan`` (``base_model_tp_plan``: base-model patterns -> strings) as entries on the wrapper ``model``."""
    modules = dict(model.named_modules())
    layer0 = model.layers["0"]
    out: dict[str, Entry] = {"embed_tokens": VocabEmbedding()}
    problems = []
    regions: set[str] = set()
    for pattern, kind in plan.items():
        hits = [n for n in modules if matches(pattern, n)]
        if not hits:
            problems.append(f"plan entry '{pattern}' ({kind}) matches no module")
            continue
        module = modules[hits[0]]
        leaf = pattern.rpartition(".")[2]
        if kind == "colwise":
            entry = Colwise()
        elif kind in ("rowwise", "rowwise_split_input"):
            entry = Rowwise()
        elif kind == "colwise_gather_output" and leaf in FUSED_QKV:
            qkv = (args.n_heads, args.n_kv_heads, args.n_kv_heads)
            entry = FusedColwise(3 if args.n_heads == args.n_kv_heads else qkv, head_dim=args.head_dim)
        elif kind == "colwise_gather_output" and leaf in FUSED_GATE_UP:
            entry = FusedColwise(2)
        elif kind == "replicated_with_grad_allreduce" and _norm(module) and module.weight.numel() == args.head_dim:
            entry = HeadNorm()
        elif kind == "sequence_parallel":
            entry = Norm()
        else:
            problems.append(f"'{pattern}': {kind!r} has no exact titanlike style")
            continue
        out[pattern] = entry
        if isinstance(entry, (Colwise, FusedColwise)) and pattern.count(".") >= 2:
            regions.add(pattern.rpartition(".")[0])
    if problems:
        raise TranslationError("; ".join(problems))
    concrete = {r: next(n for n in modules if matches(r, n)) for r in sorted(regions)}
    keywords = _stream_keywords(model, list(concrete.values()))
    for region, name in concrete.items():
        out[region] = Region(keyword=keywords.get(name))
    for name, child in layer0.named_children():
        if _norm(child) and f"layers.*.{name}" not in out:
            out[f"layers.*.{name}"] = Norm()
    out["norm"] = Norm()
    out["lm_head"] = Head()
    return out


_CACHE: dict[str, dict[str, Entry] | TranslationError] = {}


def sharding_for(args: HFArgs) -> dict[str, Entry]:
    """The entries of ``args``' model; TranslationError (one line) when its plan cannot be expressed."""
    key = json.dumps(args.config, sort_keys=True, default=str)
    if key not in _CACHE:
        try:
            _CACHE[key] = _sharding(args)
        except TranslationError as e:
            _CACHE[key] = e
    if isinstance(_CACHE[key], TranslationError):
        raise _CACHE[key]
    return dict(_CACHE[key])


def _sharding(args: HFArgs) -> dict[str, Entry]:
    model = meta_model(args)
    plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    if not plan:
        raise TranslationError(
            f"model_type '{args.model_type}' declares no base_model_tp_plan, so there is no tensor-parallel plan "
            f"to translate; use tensor_parallel_degree 1"
        )
    return translate(args, plan, model)
