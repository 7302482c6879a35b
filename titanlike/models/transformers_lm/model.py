"""A Hugging Face ``transformers`` decoder-only ``*ForCausalLM``, built from its ``config.json`` by transformers
itself, re-hung as the package's roles (``model.name = "hf"``, ``model.hf_config = <folder>``).

:class:`HFCausalLM` builds ``AutoModelForCausalLM.from_config(config)`` (on the meta device when the trainer builds
it) and keeps the library's own modules, unchanged, as its direct children:

* input modules: ``embed_tokens`` (the base model's token table);
* the block container: ``layers``, an ``nn.ModuleDict`` of the library's decoder layers keyed by global index;
* output modules: ``norm`` (the final norm), ``lm_head``.

Its forward is transformers' own loop, written out so that a pipeline stage (the model with other stages' modules
removed) runs with no wrapper: each decoder layer gets what the library's base model passes it
(``position_embeddings`` = the rotary table's ``(cos, sin)``, ``position_ids``, ``attention_mask=None``: under
``attn_implementation="sdpa"`` with no padding mask transformers' ``create_causal_mask`` returns None and the SDPA
interface runs ``is_causal=True``; measured with transformers 5.24, :func:`check_forward`). The rotary table holds
only non-persistent buffers; it is kept outside the module tree (every stage recomputes it, the pipeline never
drops it, the state dict never holds it) and rebuilt on the device by :meth:`HFCausalLM.init_buffers`.

**Checked, never trusted** (:func:`args_from_folder`, before any process group; one line naming every problem): the
folder and its ``config.json``, a decoder-only ``*ForCausalLM`` (no encoder-decoder), dropout 0, full causal or
sliding-window attention on every layer (a sliding layer gets the window's boolean mask, as the library's mask
functions build it: :func:`layer_windows`), a module tree of exactly those roles, and the forward: a small copy of
the config (one layer, narrow, a window that acts) is
built in float64 and the wrapper's logits must equal transformers' own forward, so a family whose forward does more
than embed -> layers -> norm -> head (Gemma's scaled embeddings, a logit soft-cap) is refused, not trained wrong.

**Tensor parallelism** of attention modules that slice a fused q|k|v with the config's *global* head counts
(Phi-3: ``qkv[..., : config.num_attention_heads * head_dim]``): each such attention gets its own copy of the config,
and a forward hook on its fused projection sets the head counts of that copy (and its ``num_key_value_heads``) to the
heads the projection's output holds (all of them on one device, this rank's under tp): exact by construction, read
from the tensor the attention slices. transformers is imported only when a model of this kind is built.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from titanlike.init import Init, normal, ones, zeros
from titanlike.models.masking import DocumentMask
from titanlike.models.spec import importer_of

CONFIG_NAME = "config.json"
# Fused projections whose output is a concatenation of chunks, by module name (transformers' naming), and the chunks.
FUSED_QKV = ("qkv_proj",)
FUSED_GATE_UP = ("gate_up_proj",)


@dataclass
class HFArgs:
    """A transformers model's args: the folder (``model.hf_config``) and its parsed config.json; the numbers the
    package reads (layout rules, planner, MFU) derived from it."""

    hf_config: str = ""  # the folder holding config.json (weights optional)
    config: dict = field(default_factory=dict)  # config.json's fields

    def replace(self, **changes) -> HFArgs:
        return replace(self, **changes)

    def _get(self, *keys, default=None):
        for k in keys:
            if self.config.get(k) is not None:
                return self.config[k]
        return default

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def dim(self) -> int:
        return int(self._get("hidden_size", "n_embd", "d_model"))

    @property
    def n_layers(self) -> int:
        return int(self._get("num_hidden_layers", "n_layer"))

    @property
    def n_heads(self) -> int:
        return int(self._get("num_attention_heads", "n_head"))

    @property
    def n_kv_heads(self) -> int:
        return int(self._get("num_key_value_heads", default=self.n_heads))

    @property
    def head_dim(self) -> int:
        return int(self._get("head_dim", default=self.dim // self.n_heads))

    @property
    def hidden_dim(self) -> int:
        return int(self._get("intermediate_size", "n_inner", default=4 * self.dim))

    @property
    def vocab_size(self) -> int:
        return int(self._get("vocab_size", default=-1))

    @property
    def max_seq_len(self) -> int:
        return int(self._get("max_position_embeddings", "n_positions", default=2048))

    @property
    def tie_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", True))

    @property
    def norm_eps(self) -> float:
        return float(self._get("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-6))

    @property
    def initializer_range(self) -> float:
        return float(self._get("initializer_range", default=0.02))

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameters of the full model (the tied head counted once), counted on the meta device."""
        model = meta_model(self)
        seen, total = set(), 0
        for name, p in model.named_parameters():
            if id(p) in seen or (not include_embedding and name.startswith("embed_tokens")):
                continue
            seen.add(id(p))
            total += p.numel()
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """6 x matmul weights (the head counted, tied or not) + 12 L (n_heads x head_dim) s (PaLM appendix B)."""
        model = meta_model(self)
        matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        return 6 * matmul + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


# ------------------------------------------------------------------------------------------------- config.json
_DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout")
# config.json's routed-expert counts across transformers' MoE families (Qwen2/3-MoE, OLMoE; Mixtral, gpt-oss,
# transformers 5's Qwen3-MoE; DeepSeek-V2/V3)
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def config_problems(config: dict) -> list[str]:
    """What the wrapper cannot train exactly, from config.json's fields alone (one line each)."""
    out = []
    if config.get("is_encoder_decoder"):
        out.append("is_encoder_decoder = true (only decoder-only *ForCausalLM models train here)")
    for key in _DROPOUTS:
        if config.get(key) not in (None, 0, 0.0):
            out.append(f"{key} = {config[key]!r} (dropout differs per layout; set it to 0)")
    kinds = {k for k in (config.get("layer_types") or []) if k not in ("full_attention", "sliding_attention")}
    linear = sorted(k for k in kinds if "linear" in k)
    if linear:  # its recurrent state would see only this rank's tokens under cp, no document resets
        out.append(
            f"layer_types {linear}: linear attention (Gated DeltaNet) trains as titanlike's qwen3_next model "
            "(model.name = 'qwen3_next', or its folder by checkpoint.initial_load_path with no --model.* flags: "
            "docs/qwen3_next.md), not through model.name 'hf'"
        )
        kinds -= set(linear)
    if kinds:
        out.append(f"layer_types {sorted(kinds)} (full causal and sliding-window attention are wired)")
    window = config.get("sliding_window")
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
        out.append(f"sliding_window = {window!r} (a window of at least 1 position, or null)")
    elif window is None and "sliding_attention" in (config.get("layer_types") or []):
        out.append("layer_types has sliding_attention layers but sliding_window = null")
    experts = [f"{k} = {config[k]}" for k in _EXPERT_COUNTS if config.get(k)]
    if experts:  # its experts would train with no expert axis, no load balancing, a TP plan with no titanlike style
        out.append(_experts_problem(config.get("model_type"), ", ".join(experts)))
    if config.get("quantization_config") is not None:
        out.append("quantization_config (quantized weights do not train)")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if not isinstance(config.get(key), int):
            out.append(f"{key} is {'missing' if key not in config else repr(config[key])} (an integer is needed)")
    return out


def _experts_problem(model_type, experts: str) -> str:
    """A mixture of experts trains as the titanlike MoE model that imports its model_type; the advice names that
    model, or says that none does yet (checkpoint.initial_load_path would refuse the model_type too)."""
    spec = importer_of(model_type)
    if spec is not None:
        return (
            f"a mixture of experts ({experts}) trains as titanlike's {spec.name} model, not through model.name 'hf': "
            f"its folder with weights by checkpoint.initial_load_path and no --model.* flags, or --model.name "
            f"{spec.name} with its --model.* flags (docs/moe.md)"
        )
    return (
        f"a mixture of experts ({experts}) does not train through model.name 'hf' (no expert parallelism, no load "
        f"balancing), and no titanlike MoE model imports model_type {model_type!r} yet: nothing trains it here yet "
        f"(docs/moe.md)"
    )


def read_folder(folder: str) -> dict:
    """config.json of ``folder`` as a dict; ValueError with one line when it is not there or not JSON."""
    p = Path(folder)
    if not folder:
        raise ValueError("model.hf_config: give the folder holding the model's config.json (model.name = 'hf')")
    if not (p / CONFIG_NAME).is_file():
        what = "does not exist" if not p.exists() else f"has no {CONFIG_NAME}"
        raise ValueError(f"model.hf_config: '{folder}' {what}; give a folder with a transformers config.json")
    try:
        config = json.loads((p / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model.hf_config: '{p / CONFIG_NAME}' is not JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"model.hf_config: '{p / CONFIG_NAME}' has no model_type (not a transformers config.json)")
    return config


def hf_config_object(config: dict):
    """transformers' config object of ``config`` (attention through SDPA)."""
    from transformers import AutoConfig

    fields = dict(config)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg._attn_implementation = "sdpa"
    return cfg


_META: dict[str, HFCausalLM] = {}


def meta_model(args: HFArgs) -> HFCausalLM:
    """The model of ``args`` on the meta device, built once per config (read-only uses: init plan, sharding,
    counts)."""
    key = json.dumps(args.config, sort_keys=True, default=str)
    if key not in _META:
        if len(_META) > 8:
            _META.clear()
        _META[key] = build_hf_model(args, device="meta")
    return _META[key]


def build_hf_model(args: HFArgs, device=None, dtype: torch.dtype | None = None) -> HFCausalLM:
    with torch.device(device) if device is not None else _nullcontext():
        return HFCausalLM(args, dtype=dtype)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def layer_windows(config) -> list[int | None]:
    """The sliding window of every layer of a transformers config object (after its ``__post_init__``), as
    transformers' mask functions apply it: ``layer_types`` naming the ``sliding_attention`` layers (Qwen2's
    ``use_sliding_window`` / ``max_window_layers``, gpt-oss, Gemma), else every layer when ``sliding_window`` is set
    (Mistral, Phi-3: ``create_sliding_window_causal_mask`` for the whole model); None: full causal attention. The
    forward check (:func:`check_forward`, with a window that acts) holds the wrapper to it."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * config.num_hidden_layers


def _small_copy(config: dict) -> dict:
    """The same architecture, one layer, narrow (for the forward check): the head grouping, the head_dim rule, the
    tie and every flag kept."""
    groups = max(
        1, config["num_attention_heads"] // (config.get("num_key_value_heads") or config["num_attention_heads"])
    )
    heads = min(groups, 4) if groups > 1 else 2
    kv = 1 if groups > 1 else heads
    small = dict(config, num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, vocab_size=64)
    small.update(hidden_size=16 * heads, intermediate_size=32, max_position_embeddings=64)
    if "head_dim" in config:
        small["head_dim"] = 16
    if config.get("layer_types"):  # the one layer sliding when any layer is, so the check covers the window
        small["layer_types"] = [
            "sliding_attention" if "sliding_attention" in config["layer_types"] else "full_attention"
        ]
    if config.get("sliding_window") is not None:
        small["sliding_window"] = 3  # acts on the check's 9 tokens
        if config.get("use_sliding_window"):
            small["max_window_layers"] = 0
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        small[key] = None if key != "pad_token_id" else 0
    return small


def check_forward(config: dict) -> str | None:
    """Why the wrapper's forward would not be transformers' (None: equal). A one-layer narrow copy of ``config`` in
    float64, random init: the wrapper's logits vs ``model(input_ids).logits`` of the same modules."""
    small = HFArgs(config=_small_copy(config))
    gen = torch.Generator().manual_seed(0)
    try:
        hf = _auto_model(small, torch.float64)
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
        wrapper = HFCausalLM(small, dtype=torch.float64, _from=hf)
        tokens = torch.randint(0, 64, (2, 9), generator=gen)
        with torch.no_grad():
            want = hf(input_ids=tokens).logits
            got = wrapper(tokens)
    except Exception as e:  # noqa: BLE001 - any failure of the library on this config is the problem to report
        return f"transformers cannot build or run it ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    if got.shape != want.shape or not torch.allclose(got, want, rtol=0, atol=1e-12):
        return (
            "its forward does more than embed_tokens -> layers -> norm -> lm_head (e.g. scaled embeddings, a "
            "logit soft-cap), which the wrapper would silently skip"
        )
    return None


_CHECKED: dict[str, str] = {}  # config.json text -> its problems ("" : none), checked once per process


def args_from_folder(folder: str) -> HFArgs:
    """The args of ``folder`` (``model.hf_config``), every problem named in one ValueError line."""
    config = read_folder(folder)
    key = json.dumps(config, sort_keys=True, default=str)
    if key not in _CHECKED:
        _CHECKED[key] = "; ".join(_problems(folder, config))
    if _CHECKED[key]:
        raise ValueError(f"model.hf_config '{folder}' ({config.get('model_type')}): " + _CHECKED[key])
    return HFArgs(hf_config=str(folder), config=config)


def _problems(folder: str, config: dict) -> list[str]:
    problems = config_problems(config)
    args = HFArgs(hf_config=str(folder), config=config)
    if not problems:
        try:
            problems += meta_model(args).structure_problems
        except Exception as e:  # noqa: BLE001 - any failure of the library on this config is the problem to report
            problems.append(f"transformers cannot build it ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if not problems:
        problem = check_forward(config)
        if problem:
            problems.append(problem)
    return problems


# ------------------------------------------------------------------------------------------------- the model
def _auto_model(args: HFArgs, dtype: torch.dtype | None):
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.get_default_dtype()
    return AutoModelForCausalLM.from_config(hf_config_object(args.config), dtype=dtype, attn_implementation="sdpa")


def _local_head_counts(attn: nn.Module, heads: int, kv_heads: int, head_dim: int) -> Callable:
    """A forward hook of ``attn``'s fused q|k|v projection: the attention's config copy and ``num_key_value_heads``
    get the head counts its output holds (``out.shape[-1] = (heads + 2 kv_heads) head_dim / r``)."""

    def hook(module, inputs, out):
        local = out.to_local() if hasattr(out, "to_local") else out  # a style's output hook may run after this one
        r = (heads + 2 * kv_heads) * head_dim // local.shape[-1]
        attn.config.num_attention_heads = heads // r
        attn.num_key_value_heads = kv_heads // r

    return hook


class HFCausalLM(nn.Module):
    """``embed_tokens`` -> ``layers`` (the library's decoder layers by global index) -> ``norm`` -> ``lm_head``; a
    pipeline stage is this module with other stages' modules removed (None / deleted)."""

    input_modules = ("embed_tokens",)
    block_container = "layers"
    output_modules = ("norm", "lm_head")
    reset_position_ids: bool = False

    def __init__(self, args: HFArgs, dtype: torch.dtype | None = None, _from=None):
        super().__init__()
        self.args = args
        hf = _from if _from is not None else _auto_model(args, dtype)
        base = getattr(hf, hf.base_model_prefix, None)
        self.structure_problems = _structure_problems(hf, base)
        if self.structure_problems:
            return
        self.config = hf.config  # a plain attribute (not a module)
        self.__dict__["rotary"] = base.rotary_emb  # outside the module tree: every stage recomputes the table
        self.embed_tokens = base.embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(base.layers)})
        self.norm = base.norm
        self.lm_head = hf.lm_head
        self.base_model_prefix = hf.base_model_prefix
        self._localize_fused_attention()

    def _localize_fused_attention(self) -> None:
        """Attention modules holding a fused q|k|v projection read the head counts from their own config copy,
        which the projection's output sets (module docstring)."""
        a = self.args
        for layer in self.layers.values():
            for name, module in layer.named_modules():
                leaf = name.rpartition(".")[2]
                if leaf in FUSED_QKV and isinstance(module, nn.Linear):
                    attn = layer.get_submodule(name.rpartition(".")[0])
                    attn.config = copy.copy(attn.config)
                    module.register_forward_hook(_local_head_counts(attn, a.n_heads, a.n_kv_heads, a.head_dim))

    def forward(self, x: torch.Tensor, document_starts: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (or a stage's hidden states) -> logits (or hidden states)."""
        if document_starts is not None:
            raise ValueError("model 'hf': block_causal masking is not wired (model.attn_mask_type = 'causal')")
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = self.positions(x)
        kwargs = self.block_kwargs(positions, like=h)
        windows = layer_windows(self.config)
        masks = {}  # sliding-window layers: the boolean (batch, 1, s, s) mask (built once per window and forward)
        if any(w is not None for w in windows):
            causal = DocumentMask.causal(h.shape[0], positions, backend="sdpa")
            masks = {w: causal.dense(0, x.shape[1], x.shape[1], w) for w in set(windows) if w is not None}
        for key, layer in self.layers.items():
            window = windows[int(key)]
            out = layer(h, **{**kwargs, "attention_mask": masks[window] if window is not None else None})
            h = out[0] if isinstance(out, tuple) else out
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h

    def positions(self, x: torch.Tensor) -> torch.Tensor:
        """The positions ``0 .. seq - 1`` of the tokens (or hidden states) ``x`` (batch, seq, ...)."""
        return torch.arange(x.shape[1], device=x.device)

    def block_kwargs(self, positions: torch.Tensor, like: torch.Tensor | None = None) -> dict:
        """What transformers' base model passes every decoder layer: the rotary ``(cos, sin)`` of ``positions`` in
        the dtype of ``like`` (the hidden states; default the parameters'), ``position_ids`` and
        ``attention_mask=None`` (causal: SDPA's ``is_causal``)."""
        if like is None:
            like = torch.empty(0, dtype=next(self.parameters()).dtype, device=positions.device)
        position_ids = positions[None]
        return dict(attention_mask=None, position_ids=position_ids, position_embeddings=self.rotary(like, position_ids))

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """The rotary table, computed on ``device``."""
        with torch.device(device or "cpu"):
            self.__dict__["rotary"] = type(self.rotary)(config=self.config)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        from titanlike.init import init_parameters

        self.init_buffers(buffer_device)
        init_parameters(self, param_init(self.args), torch.initial_seed() if seed is None else seed)


_ROLES = {"embed_tokens", "layers", "norm", "rotary_emb"}


def _structure_problems(hf: nn.Module, base: nn.Module | None) -> list[str]:
    """The module tree must be exactly the roles (anything with state elsewhere would be skipped by the forward)."""
    if base is None or not isinstance(getattr(hf, "lm_head", None), nn.Linear):
        return [f"{type(hf).__name__} is not a base model + lm_head (no '{hf.base_model_prefix}' / lm_head)"]
    out = []
    missing = sorted(r for r in _ROLES if getattr(base, r, None) is None)
    if missing:
        out.append(f"its base model {type(base).__name__} has no {', '.join(missing)}")
    extra = sorted(n for n, m in base.named_children() if n not in _ROLES and (any(m.parameters()) or any(m.buffers())))
    extra += sorted(
        n
        for n, m in hf.named_children()
        if n not in (hf.base_model_prefix, "lm_head") and (any(m.parameters()) or any(m.buffers()))
    )
    if extra:
        out.append(f"modules outside embed_tokens / layers / norm / lm_head hold state: {', '.join(extra)}")
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        out.append("its layers are not an nn.ModuleList")
    return out


# ------------------------------------------------------------------------------------------------- init
def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def param_init(args: HFArgs) -> Callable[[str], Init]:
    """Every parameter's distribution by FQN, as transformers' ``_init_weights`` draws it: Linear and Embedding
    weights normal(0, ``initializer_range``), biases zeros, norm weights ones (biases zeros); a tied head is the
    embedding. Read off the module tree (built on meta once per args)."""
    model = meta_model(args)
    std = args.initializer_range
    table: dict[str, Init] = {}
    owner: dict[int, str] = {}
    for mname, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            fqn = f"{mname}.{leaf}" if mname else leaf
            if id(p) in owner:  # a tied copy
                table[fqn] = table[owner[id(p)]].tied_to(owner[id(p)])
                continue
            owner[id(p)] = fqn
            if isinstance(module, (nn.Linear, nn.Embedding)) and leaf == "weight":
                table[fqn] = normal(std)
            elif leaf == "bias":
                table[fqn] = zeros()
            elif _is_norm(module) and leaf == "weight":
                table[fqn] = ones()
    tied_head = "lm_head.weight"
    if tied_head in table and model.lm_head.weight is model.embed_tokens.weight:
        table[tied_head] = table["embed_tokens.weight"].tied_to("embed_tokens.weight")

    def plan(fqn: str) -> Init:
        if fqn not in table:
            from titanlike.init import InitPlanError

            raise InitPlanError(f"init: no distribution for parameter '{fqn}' of the transformers model")
        return table[fqn]

    return plan


__all__ = ["HFArgs", "HFCausalLM", "args_from_folder", "check_forward", "meta_model", "param_init"]
