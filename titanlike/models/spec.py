"""Model specs: one object per model that tells the rest of the package everything it needs to know.

torchtitan's ``TrainSpec`` idea, kept small. Each model lives in ``titanlike/models/<name>/`` and registers one
:class:`ModelSpec` with :func:`register`; the trainer, pipeline, FSDP grouping, checkpoints, Hugging Face interop,
planner and benchmark ask the spec (``titanlike.models.get_spec`` by ``model.name``, ``titanlike.models.spec_for``
by model or args object: :mod:`titanlike.models.registry`, which imports the built-in models) and never name a
model class. This module imports no model package: the model packages import it. See docs/adding_a_model.md.

Roles (module FQNs of the full model, all direct children of the root), read off the model class (a
``titanlike.models.decoder.Decoder`` declares them) unless the spec gives them:

* ``input_modules``: run first, on token ids (``tok_embeddings``, and ``pos_embeddings`` for GPT-2);
* ``block_container``: the ``nn.ModuleDict`` of blocks keyed by global index (pipeline split, FSDP groups, AC,
  compile);
* ``output_modules``: run last, produce logits (final norm + head).

Tied parameters are found by identity wherever they matter (``titanlike.parallel.ties``), not listed here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ActivationSizes", "ModelSpec", "UnknownModelError", "importer_of", "lookup", "register"]


class UnknownModelError(ValueError):
    """``model.name`` is not a registered model (the message lists the registered ones)."""


@dataclass(frozen=True)
class ActivationSizes:
    """What the planner's activation model (``titanlike.planner.memory``) hands a model's ``attention_activations``
    hook: the AC mode of the block (``"none"`` or selective ``"op"``; full AC keeps the block input only), the
    activation and compute bytes per number (bf16: 2 and 4), the tp degree, the keys one query's sequence has (the
    microbatch's local sequence) and ``probe``: the kernels the dry run's probe runs (torch on CPU: SDPA's math path
    where the query / key and value head widths differ) instead of CUDA's (the memory-efficient kernel takes them);
    ``batch``: the microbatch's sequences (for what a block keeps once, whatever the batch) and ``cp``: the context
    parallel degree."""

    mode: str
    act_bytes: int
    compute_bytes: int
    tp: int
    seq: int
    probe: bool = False
    batch: int = 1
    cp: int = 1


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]  # model_cls(args) builds the whole model (on the meta device: build_meta)
    args_cls: type
    flavors: dict[str, object]
    # How the modules split over tensor parallelism: {module pattern: titanlike.sharding entry}, plain data from
    # models/<name>/sharding.py. The translator (titanlike.parallel.tensor_parallel.tp_plan) makes the TP plan of
    # it, the planner every parameter's TP and FSDP dims, the float8 conversion its eligible Linears. Empty: no TP.
    sharding: Mapping[str, object] = field(default_factory=dict)
    # Roles (None: the model class's attributes of the same names).
    input_modules: tuple[str, ...] | None = None
    output_modules: tuple[str, ...] | None = None
    block_container: str | None = None
    # Extra shape rules of this model (one line with the fix per violation), on top of the shared ones.
    shape_violations: Callable[[object], list[str]] = lambda args: []
    # The planner's view of a linear-attention layer (titanlike.models.linear_attention): linear_attention(args, i) ->
    # (v_heads, dk, dv, conv_channels, conv_kernel) of block i, None when it attends with softmax (its cp messages are
    # the K/V gathers; a linear one's the state maps and conv halos of titanlike.parallel.state_passing).
    linear_attention: Callable[[object, int], tuple[int, int, int, int, int] | None] = lambda args, i: None
    # Extra tensor-parallel rules of this model: tp_violations(args, tp) (Qwen3-Next: tp divides its linear-attention
    # key heads), one line with the fix each; checked by the layout rules (rule tp_model) before any process starts.
    tp_violations: Callable[[object, int], list[str]] = lambda args, tp: []
    # Hugging Face adapter: the module (titanlike/models/<name>/hf.py) implementing titanlike.hf.HFAdapter; its
    # MODEL_TYPE is the config.json model_type import picks it by.
    hf_adapter: str = ""
    # Why a model of these args cannot be exported to Hugging Face (one line each; checked up front when
    # checkpoint.export_safetensors is on): what the adapter's format cannot express (Qwen3-MoE: an expert bias).
    hf_export_violations: Callable[[object], list[str]] = lambda args: []
    # param_init(args) -> (full-model FQN -> titanlike.init.Init): every parameter's distribution (None: the model
    # class's param_init). The sharded, layout-independent init (titanlike.parallel.materialize) fills each rank's
    # shards from it; a tied copy names its owner (Init.key). The model class also has init_buffers(device).
    param_init: Callable[[object], Callable[[str], object]] | None = None
    # The block's structure, for the planner's activation-memory model (titanlike.planner.memory): its norms
    # ("rms": RMSNorm computed in float32; "rms_zero_centred": the same scaled by ``1 + w`` in float32, keeping the
    # float32 normalised input and ``1 + w``; "layer": LayerNorm) and its MLP ("swiglu": w1, w3, w2; "gelu": fc, proj).
    norm_kind: str = "rms"
    mlp_kind: str = "swiglu"
    # attention_activations(args, layer_id, ActivationSizes) -> bytes per token that block's attention keeps for its
    # backward between its norm's output and its output projection (projections, norms inside, the kernel's saved
    # tensors, the output projection's input; selective op AC: the matmul / kernel outputs), for a model whose
    # attention is no plain ``n_heads x head_dim`` softmax one (MLA's latents); None: the planner's softmax formula.
    attention_activations: Callable[[object, int, ActivationSizes], float | None] = lambda args, i, sizes: None
    # prediction_blocks(args) -> {FQN: layer id} of the blocks the output modules run after the final norm
    # (DeepSeek-V3's multi-token prediction depths ``mtp.K.block``), each after two norms and a projection of their
    # concatenation, each followed by a norm and the shared head: the planner counts their activations and messages
    # on the last stage.
    prediction_blocks: Callable[[object], dict[str, int]] = lambda args: {}
    # Capabilities the layout rules check (titanlike.layout.rules), declared by the model, never inferred from its
    # name. context_parallel: attention through the shared seam and every position lookup through the position seam
    # (titanlike.models.decoder), so titanlike.parallel.context_parallel applies. te_norm: the norm class whose
    # instances Transformer Engine may replace by te.RMSNorm (with the blocks' nn.Linear by te.Linear; None: no TE).
    # float8: the sharding entries marked float8=True (titanlike.sharding.float8_patterns).
    context_parallel: bool = False
    # block_causal: the blocks take the forward's DocumentMask and pass it to the attention seam
    # (model.attn_mask_type = "block_causal"; docs/masking.md).
    block_causal: bool = True
    te_norm: type | None = None
    # num_experts(args): the routed experts of each MoE block (titanlike.models.moe.MoE; 0: a dense model). The
    # layout rules check the expert-parallel degree against it, parallelize_model applies expert parallelism where it
    # is above 0.
    num_experts: Callable[[object], int] = lambda args: 0
    # A model whose sharding depends on its args (a transformers model: translated from its config's plan):
    # sharding_fn(args) -> the entries; read through sharding_of(args). ValueError (one line): no exact plan.
    sharding_fn: Callable[[object], Mapping[str, object]] | None = None
    # A model without flavors (a transformers model: its config.json): args_from_overrides({model.<key>: value} of
    # the keys it reads) -> its args; ValueError (one line naming every problem) for bad input.
    args_from_overrides: Callable[[dict], object] | None = None

    def __post_init__(self):
        for name in ("input_modules", "output_modules", "block_container", "param_init"):
            if getattr(self, name) is None:
                value = getattr(self.model_cls, name, None)
                if value is None and name != "param_init":
                    raise ValueError(
                        f"ModelSpec '{self.name}': give {name} (or a model class that declares it, like "
                        f"titanlike.models.decoder.Decoder subclasses)"
                    )
                object.__setattr__(self, name, tuple(value) if isinstance(value, list) else value)

    # -------------------------------------------------------------------- helpers used across the package
    def args_from_record(self, record: dict):
        """The args recorded as JSON (checkpoint.json's ``model_args``): JSON lists back to the tuples they were."""

        def value(v):
            return tuple(value(x) for x in v) if isinstance(v, list) else v

        return self.args_cls(**{k: value(v) for k, v in record.items()})

    def build(self, args) -> nn.Module:
        """The whole model of ``args`` (pipeline stages are cut from it: titanlike.parallel.pipeline)."""
        return self.model_cls(args)

    def build_meta(self, args) -> nn.Module:
        with torch.device("meta"):
            return self.build(args)

    def sharding_of(self, args) -> Mapping[str, object]:
        """The sharding entries of the model of ``args`` (``sharding``, or ``sharding_fn(args)``)."""
        return self.sharding if self.sharding_fn is None or args is None else self.sharding_fn(args)

    def flops_per_token(self, args, seq_len: int) -> int:
        return args.flops_per_token(seq_len)

    def hf(self):
        import importlib

        if not self.hf_adapter:
            raise ValueError(f"model '{self.name}' has no Hugging Face adapter")
        return importlib.import_module(self.hf_adapter)


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"a model named '{spec.name}' is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def importer_of(model_type) -> ModelSpec | None:
    """The registered spec whose Hugging Face adapter imports config.json's ``model_type`` (not an adapter that
    reads any config.json for its own model's weights), among the models registered so far; None: no model does."""
    for spec in _REGISTRY.values():
        if spec.hf_adapter:
            adapter = spec.hf()
            if not getattr(adapter, "ANY_MODEL_TYPE", False) and adapter.MODEL_TYPE == model_type:
                return spec
    return None


def lookup(obj) -> ModelSpec | None:
    """The registered spec whose model or args class ``obj`` is an instance of, the most derived class first (a
    model subclassing another registered one gets its own spec), among the models registered so far
    (``titanlike.models.spec_for`` loads the built-in ones first)."""
    for cls in type(obj).__mro__:
        for spec in _REGISTRY.values():
            if cls is spec.model_cls or cls is spec.args_cls:
                return spec
    return None
