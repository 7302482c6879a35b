"""The scaffolding every built-in decoder shares: input modules -> blocks keyed by global index -> norm -> head.

A model subclasses :class:`Decoder` and keeps only what differs (its blocks, its input modules, what the blocks
receive besides the hidden states). What the base gives, and the rest of the package relies on:

* **roles** as class attributes, read by the model spec (``titanlike.models.spec``): ``input_modules`` (run first,
  on token ids), ``block_container`` (an ``nn.ModuleDict`` of blocks keyed by their global index, so a pipeline
  stage keeps the full model's FQNs: ``layers.5.attention.wq.weight``), ``output_modules`` (final norm + head);
* **a forward that skips ``None`` modules**, the pipeline contract (``titanlike.parallel.pipeline.build_stage``
  keeps a stage's modules and sets the others to None or deletes them from the container): without the input
  modules it takes hidden states, without the head it returns them;
* **tied embeddings** (``args.tie_embeddings``: the head's weight is the token table);
* **two seams** that context parallelism swaps from outside (``titanlike.parallel.context_parallel``), shared by
  every model so that one transform serves them all: :class:`AttentionCore` (the causal softmax attention of
  ``q, k, v``) and :class:`Positions` (the positions of the tokens this rank holds, from which RoPE rows and
  learned position embeddings are looked up);
* ``init_weights`` / ``init_buffers`` over the model's ``param_init`` (``titanlike.init``: each element a pure
  function of (seed, FQN, index), the same values under every layout).

**Document masking** (``titanlike.models.masking``): ``forward(x, document_starts=...)`` (each token's document start
in the window, carried with the batch) makes the mask block-causal: the forward builds one
:class:`~titanlike.models.masking.DocumentMask` and hands it to every block as the ``mask`` keyword argument, which
the model's attention passes to its seam (``core(q, k, v, mask)``); with ``reset_position_ids`` the positions
restart at every document start. Torch's pipeline stages hand every stage the step's keyword arguments, split by
microbatch, so the starts travel with each microbatch: no further seam is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from titanlike.init import Init, init_parameters
from titanlike.models.kv_cache import (
    CachedLatentAttention,
    CachedPositions,
    CachedSoftmaxAttention,
    DecodeState,
    SequenceSeam,
    UnreadWindow,
)
from titanlike.models.masking import DocumentMask

__all__ = [
    "AttentionCore",
    "Decoder",
    "DecoderBlock",
    "LatentAttentionCore",
    "Positions",
    "SequenceWindow",
    "attention_windows",
]


class AttentionCore(SequenceSeam):
    """The attention seam: causal softmax attention of ``q`` (batch, seq, heads, head_dim) over ``k``, ``v``
    (batch, seq, kv_heads, head_dim), kv heads shared by groups of query heads (SDPA's ``enable_gqa``: query head
    ``i`` uses kv head ``i // (heads / kv_heads)``, as ``repeat_interleave`` would pair them); returns (batch, seq,
    heads, head_dim). No parameters. Every model calls its attention through one of these, so context parallelism
    replaces it from outside (``ContextParallelAttention``) without touching the projections. ``mask``: None
    (causal: SDPA's causal fast path) or the forward's :class:`~titanlike.models.masking.DocumentMask`
    (block-causal).

    Per-layer options (``titanlike.models.masking``): ``window`` (a sliding window of ``window`` positions, the query
    itself included: transformers' convention; None: full attention), ``sinks`` (True: the layer is called with
    ``core(q, k, v, mask, sinks=...)``, one learned logit per head, the attention module's parameter). A model whose
    seams have either gets a causal ``DocumentMask`` from the forward even without documents."""

    attention_seam = True  # the decoder's forward reads window / sinks off every module that says so

    def __init__(self, window: int | None = None, sinks: bool = False):
        super().__init__()
        if window is not None and window < 1:
            raise ValueError(f"AttentionCore: window must be >= 1 or None (full attention), got {window}")
        self.window, self.sinks = window, sinks

    def extra_repr(self) -> str:
        return ", ".join(s for s in (f"window={self.window}" * (self.window is not None), "sinks" * self.sinks) if s)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: DocumentMask | None = None,
        sinks: torch.Tensor | None = None,
    ):
        # Grouped-query attention (each kv head serves heads / kv_heads query heads) through SDPA's own
        # ``enable_gqa`` (and FlexAttention's): k and v are read in place, never repeated to every query head
        # (``DocumentMask.attend``: the explicit sinks path repeats them, where its scores cost far more anyway).
        gqa = q.shape[2] != k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        plain = self.window is None and sinks is None
        if mask is None and not plain:  # called outside a decoder's forward: the causal mask, built here
            mask = DocumentMask.causal(q.shape[0], torch.arange(q.shape[2], device=q.device), (self.window,))
        if mask is None or (plain and not mask.documents):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = mask.attend(q, k, v, window=self.window, sinks=sinks)
        return out.transpose(1, 2)

    def kv_cache(self, state: DecodeState) -> nn.Module | None:
        """This seam's cached counterpart for a decode of ``state`` (``titanlike.models.kv_cache``): the softmax
        cache, with this seam's window (and sinks, passed at call time). A subclass that attends differently (a
        latent or linear attention) returns its own cache, or None ("cannot cache yet": generation then recomputes
        the sequence); one that overrides ``forward`` without overriding this method gets None, never this cache."""
        if type(self).forward is not AttentionCore.forward:
            return None
        return CachedSoftmaxAttention(state, window=self.window)


def attention_windows(model: nn.Module) -> tuple | None:
    """The windows (None: full attention) of ``model``'s attention seams when some seam needs a mask without
    documents (a window, sinks), else None (the causal fast path)."""
    seams = [m for m in model.modules() if getattr(m, "attention_seam", False)]
    if not any(m.window is not None or m.sinks for m in seams):
        return None
    return tuple(dict.fromkeys(m.window for m in seams))


class LatentAttentionCore(SequenceSeam):
    """The attention seam of a model whose keys and values are expanded from a compressed latent (multi-head latent
    attention, DeepSeek-V2/V3): ``core(q, latent, k_rope, expand, mask=None)`` with ``latent`` (batch, seq, rank) and
    the shared RoPE key ``k_rope`` (batch, seq, 1, rope dim), already rotated at the tokens' positions, and
    ``expand(latent, k_rope) -> (k, v)`` the model's up-projection to per-head keys and values; then the causal
    softmax attention of :class:`AttentionCore`. No parameters (``expand`` carries them). Context parallelism
    replaces it from outside (``ContextParallelLatentAttention``), gathering the latent and the RoPE key, not the
    per-head keys and values, and expanding them locally."""

    window, sinks = None, False  # full attention without sinks: AttentionCore's causal path

    def forward(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, expand, mask=None):
        k, v = expand(latent, k_rope)
        return AttentionCore.forward(self, q, k, v, mask)

    def kv_cache(self, state: DecodeState) -> nn.Module | None:
        """The latent cache (``titanlike.models.kv_cache.CachedLatentAttention``: the latent and the RoPE key of
        every token); None for a subclass that overrides ``forward``."""
        return CachedLatentAttention(state) if type(self).forward is LatentAttentionCore.forward else None


class Positions(nn.Module):
    """The position seam: the positions ``(seq,)`` of the tokens of ``x`` (batch, seq, ...): ``0 .. seq - 1`` on
    one device; under context parallelism the global positions of this rank's chunks. No parameters, no buffers
    (so every pipeline stage keeps it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.arange(x.shape[1], device=x.device)

    def kv_cache(self, state: DecodeState) -> nn.Module:
        """During a cached decode: each row's positions of this step's tokens (after its left padding)."""
        return CachedPositions(state)


class SequenceWindow(SequenceSeam):
    """The window seam: the whole window of a per-token tensor ``t`` (batch, seq), in sequence order, for a model that
    looks other positions' token ids up (multi-token prediction: the tokens k ahead, read at the position seam's
    positions + k). On one device ``t`` itself; under context parallelism every cp rank's part gathered
    (``ContextParallelWindow``). No parameters, no gradient."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def kv_cache(self, state: DecodeState) -> nn.Module:
        """Read by training-mode modules only (MTP): during a decode a module that refuses to be called."""
        return UnreadWindow()


def _seed(seed: int | None) -> int:
    return torch.initial_seed() if seed is None else seed


class DecoderBlock(nn.Module):
    """Base of a model's blocks: its global index ``layer_id`` and the model's ``args``; ``param_init`` (class
    attribute): the model's init plan, so a block alone initialises as the full model does."""

    param_init: ClassVar[Callable[[object], Callable[[str], Init]]]

    def __init__(self, layer_id: int, args):
        super().__init__()
        self.layer_id = layer_id
        self.args = args

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """This block's weights as the full model's init makes them (``seed``: default ``torch.initial_seed()``)."""
        plan = type(self).param_init(self.args)
        init_parameters(self, plan, _seed(seed), prefix=f"{Decoder.block_container}.{self.layer_id}.")


class Decoder(nn.Module):
    """The decoder, or a pipeline stage of it (modules of other stages None, blocks of other stages deleted).

    Subclasses build their input modules (the names in ``input_modules``), then call :meth:`_build_trunk` with
    their block constructor and final norm, and implement :meth:`embed` (and :meth:`block_kwargs` when the blocks
    take more than the hidden states). ``param_init(args)``: the model's init plan (class attribute, a function).
    """

    input_modules: ClassVar[tuple[str, ...]] = ("tok_embeddings",)
    output_modules: ClassVar[tuple[str, ...]] = ("norm", "output")
    block_container: ClassVar[str] = "layers"
    param_init: ClassVar[Callable[[object], Callable[[str], Init]]]
    # RoPE / learned positions restart at 0 at every document start (needs ``document_starts``); set from
    # ``model.reset_position_ids`` by the builder (an instance attribute: pipeline stages, copies, keep it).
    reset_position_ids: bool = False

    def __init__(self, args):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError(f"{type(args).__name__}.vocab_size is not set: take it from the tokenizer")
        self.args = args

    def _build_trunk(self, block: Callable[[int], nn.Module], norm: nn.Module) -> None:
        """The position seam, the blocks ``block(i)`` keyed by global index, the final norm and the head (tied to
        ``tok_embeddings`` when ``args.tie_embeddings``)."""
        args = self.args
        self.positions = Positions()
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(args.n_layers)})
        self.norm = norm
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    # ---------------------------------------------------------------------------------------- what models define
    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The input modules: token ids (batch, seq) -> hidden states (batch, seq, dim)."""
        return self.tok_embeddings(tokens)

    def block_kwargs(self, positions: torch.Tensor) -> dict:
        """What every block receives besides the hidden states (keyword arguments), e.g. the RoPE rows of
        ``positions`` ((seq,), or (batch, seq) when positions restart per document). Under document masking the
        forward adds ``mask``, which the block's attention passes to its seam."""
        return {}

    # ---------------------------------------------------------------------------------------- the shared forward
    def _has_inputs(self) -> bool:
        present = [getattr(self, n, None) is not None for n in self.input_modules]
        if any(present) and not all(present):
            missing = [n for n, p in zip(self.input_modules, present) if not p]
            raise ValueError(
                f"{type(self).__name__}: a stage holds some input modules but not {', '.join(missing)}; keep "
                f"{', '.join(self.input_modules)} together on the first stage"
            )
        return all(present)

    def forward(self, x: torch.Tensor, document_starts: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (or a stage's hidden states) -> logits (or hidden states). ``document_starts`` (batch, seq of
        the local tokens): the block-causal mask (``titanlike.models.masking``); None: causal."""
        positions = self.positions(x)
        mask, windows = None, attention_windows(self)
        if document_starts is not None:
            mask = DocumentMask(document_starts, positions, windows=windows or (None,))
            if self.reset_position_ids:
                positions = positions - document_starts  # (batch, seq): restart at every document start
        elif self.reset_position_ids:
            raise ValueError(
                f"{type(self).__name__}: reset_position_ids needs the batch's document_starts "
                f"(model.attn_mask_type = 'block_causal')"
            )
        if mask is None and windows is not None:  # windows / sinks: the causal mask, built here (outside the blocks)
            mask = DocumentMask.causal(x.shape[0], positions, windows)
        h = self.embed(x, positions) if self._has_inputs() else x
        kwargs = self.block_kwargs(positions)
        if mask is not None:
            kwargs["mask"] = mask
        for block in self.layers.values():
            h = block(h, **kwargs)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    # ---------------------------------------------------------------------------------------- initialisation
    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """(Re)compute the non-persistent buffers (none here; RoPE tables in models that have them)."""

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None) -> None:
        """(Re)initialise every buffer and parameter, sharded (DTensor) ones too, each rank its own elements: the
        model's ``param_init`` from ``seed`` (default ``torch.initial_seed()``), the same values under every
        layout."""
        self.init_buffers(buffer_device)
        init_parameters(self, type(self).param_init(self.args), _seed(seed))
