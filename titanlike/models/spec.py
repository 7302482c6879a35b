"""Model specs: one object per model that tells the rest of the package everything it needs to know.

torchtitan's ``TrainSpec`` idea, kept small. Each model lives in ``titanlike/models/<name>/`` and registers one
:class:`ModelSpec` with :func:`register`; the trainer, pipeline, FSDP grouping, checkpoints, Hugging Face interop,
planner and benchmark ask the spec (:func:`get_spec` by ``model.name``, :func:`spec_for` by model or args object)
and never name a model class. See docs/adding_a_model.md.

Roles (module FQNs of the full model, all direct children of the root):

* ``input_modules``: run first, on token ids (``tok_embeddings``, and ``pos_embeddings`` for GPT-2);
* ``block_container``: the ``nn.ModuleDict`` of blocks keyed by global index (pipeline split, FSDP groups, AC,
  compile);
* ``output_modules``: run last, produce logits (final norm + head);
* ``tied``: ``(input parameter, output parameter)`` FQN pairs that are one parameter when ``args.tie_embeddings``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DEFAULT_MODEL", "ModelSpec", "register", "get_spec", "spec_for", "registered", "UnknownModelError"]

# The model a name-less reference means: checkpoints written before there were several models record none.
DEFAULT_MODEL = "llama3"


class UnknownModelError(ValueError):
    """``model.name`` is not a registered model (the message lists the registered ones)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    args_cls: type
    flavors: dict[str, object]
    # build(args, layer_ids=None, has_input=True, has_output=True) -> the model or one pipeline stage of it, with
    # the full model's FQNs (the partial-stage constructor).
    build: Callable[..., nn.Module]
    input_modules: tuple[str, ...]
    output_modules: tuple[str, ...]
    block_container: str = "layers"
    tied: tuple[tuple[str, str], ...] = ()
    # tp_plan(args, sequence_parallel, loss_parallel, float8=False) -> {module-path pattern: ParallelStyle}. None:
    # a built-in model, whose plan lives in titanlike.parallel (titanlike.parallel.tensor_parallel.model_tp_plan):
    # the models import nothing of the parallel package.
    tp_plan: Callable[..., dict] | None = None
    # Extra shape rules of this model (one line with the fix per violation), on top of the shared ones.
    shape_violations: Callable[[object], list[str]] = lambda args: []
    # The config overrides (model.<key>) this model reads; the others must stay unset.
    config_keys: tuple[str, ...] = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len")
    # Hugging Face adapter: a module with to_hf, from_hf, hf_config, model_args_from_hf_config,
    # check_same_architecture (see titanlike/hf.py for the Llama one).
    hf_adapter: str = ""
    hf_model_type: str = ""
    # Planner: shard_dims(fqn, tp_enabled, fsdp_enabled) -> (tensor-parallel dim or None, FSDP dim) of a parameter,
    # as this model's plan and apply_fsdp shard it (None: the Llama rules of titanlike.planner.memory).
    shard_dims: Callable[[str, bool, bool], tuple[int | None, int]] | None = None
    # param_init(args) -> (full-model FQN -> titanlike.init.Init): every parameter's distribution. The sharded,
    # layout-independent init (titanlike.parallel.materialize) fills each rank's shards from it; a tied copy names
    # its owner (Init.key). The model class also has init_buffers(device) for its non-persistent buffers.
    param_init: Callable[[object], Callable[[str], object]] | None = None
    # The block's structure, for the planner's activation-memory model (titanlike.planner.memory): its norms
    # ("rms": RMSNorm computed in float32; "layer": LayerNorm) and its MLP ("swiglu": w1, w3, w2; "gelu": fc, proj).
    norm_kind: str = "rms"
    mlp_kind: str = "swiglu"

    # -------------------------------------------------------------------- helpers used across the package
    def build_meta(self, args, **kw) -> nn.Module:
        with torch.device("meta"):
            return self.build(args, **kw)

    def param_shapes(self, args, names: Sequence[str] | None = None) -> dict[str, tuple[int, ...]]:
        """FQN -> shape of each parameter of the model (or of the stage holding ``names``), tied ones once."""
        kw = {} if names is None else self.stage_kwargs(names)
        return {k: tuple(p.shape) for k, p in self.build_meta(args, **kw).named_parameters()}

    def stage_kwargs(self, names: Sequence[str]) -> dict:
        """``build`` keyword arguments of the pipeline stage holding the module FQNs ``names``."""
        prefix = self.block_container + "."
        return dict(
            layer_ids=[int(n[len(prefix) :]) for n in names if n.startswith(prefix)],
            has_input=any(n in names for n in self.input_modules),
            has_output=any(n in names for n in self.output_modules),
        )

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


def _load_builtin() -> None:
    import titanlike.models.gpt2  # noqa: F401
    import titanlike.models.llama  # noqa: F401


def registered() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_spec(name: str) -> ModelSpec:
    _load_builtin()
    if name not in _REGISTRY:
        raise UnknownModelError(f"model.name: unknown model '{name}'; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def spec_for(obj) -> ModelSpec | None:
    """The spec whose model or args class ``obj`` (a model, a pipeline stage, or its args) is an instance of."""
    _load_builtin()
    for spec in _REGISTRY.values():
        if isinstance(obj, (spec.model_cls, spec.args_cls)):
            return spec
    return None


def check_state_dict_fits(out: dict, args, hf_name, hint=None) -> None:
    """Refuse a converted Hugging Face state dict whose names or shapes are not exactly those of the model of
    ``args`` (one ValueError naming the first missing / extra parameter or wrong shape, in Hugging Face names).
    ``hint(fqn, got, want)`` may add a sentence to a shape mismatch."""
    expected = {k: v.shape for k, v in spec_for(args).build_meta(args).state_dict().items()}
    missing = [k for k in expected if k not in out]
    extra = [k for k in out if k not in expected]
    if missing or extra:
        what = f"lacks {hf_name(missing[0])}" if missing else f"has {hf_name(extra[0])}, which this model has not"
        raise ValueError(f"the Hugging Face weights do not fit the model ({args.n_layers} layers): the file {what}")
    for k, shape in expected.items():
        got = tuple(out[k].shape)
        if got != tuple(shape):
            extra_hint = hint(k, got, tuple(shape)) if hint else ""
            raise ValueError(
                f"the Hugging Face weights do not fit the model: {hf_name(k)} has shape {got}, the "
                f"model needs {tuple(shape)}{extra_hint}"
            )
