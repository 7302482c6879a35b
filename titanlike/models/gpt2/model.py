"""GPT-2 in plain ``torch.nn``: learned positions, LayerNorm with bias, one fused ``c_attn`` (q|k|v) with bias,
GELU MLP, tied embeddings. Same structure as OpenAI's / Hugging Face's ``GPT2LMHeadModel`` (whose ``Conv1D``
weights are the transposes of our ``nn.Linear`` ones; titanlike/models/gpt2/hf.py converts).

Like the Llama model it knows nothing of parallelism:

* attention infers its number of heads from the (possibly sharded) ``c_attn`` output: q, k and v are the three
  equal thirds of whatever this rank computes, so a tensor-parallel style only has to give each rank its heads
  of each of the three chunks (``titanlike.parallel.fused.FusedColwiseParallel``; models/gpt2/sharding.py);
* it is a :class:`~titanlike.models.decoder.Decoder`: blocks in an ``nn.ModuleDict`` keyed by global index, so a
  pipeline stage keeps the full model's FQNs; attention through the shared seam (``attn.core``) and the position
  table looked up at the shared position seam's positions, so context parallelism applies as to every model;
* it can be built on the meta device and materialised with :meth:`GPT2.init_weights`, whose values are a pure
  function of (seed, parameter FQN, element index) (:func:`param_init`, ``titanlike.init``), so a sharded model
  fills each rank's shards with exactly the single-device values.

Module names: ``tok_embeddings`` (wte), ``pos_embeddings`` (wpe), ``layers.N.{ln_1, attn.c_attn, attn.c_proj,
ln_2, mlp.c_fc, mlp.c_proj}``, ``norm`` (ln_f), ``output`` (lm_head).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titanlike.init import Init, normal, ones, plan_from_patterns, zeros
from titanlike.models.decoder import AttentionCore, Decoder, DecoderBlock


@dataclass
class GPT2Args:
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = -1  # set from the tokenizer (then padded to ``vocab_multiple``)
    ffn_hidden_dim: int | None = None  # None: 4 * dim
    norm_eps: float = 1e-5
    max_seq_len: int = 1024
    tie_embeddings: bool = True

    @property
    def n_kv_heads(self) -> int:  # multi-head attention: as many k/v heads as q heads
        return self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim if self.ffn_hidden_dim is not None else 4 * self.dim

    def replace(self, **changes) -> GPT2Args:
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count of the full model (the tied head counted once; positions are embeddings)."""
        d, h, L = self.dim, self.hidden_dim, self.n_layers
        per_layer = (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d) + 4 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        emb = self.vocab_size * d + self.max_seq_len * d
        return L * per_layer + 2 * d + head + (emb if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> int:
        """6 x matmul weights (the head counted, tied or not) + 12 L d s for attention (PaLM appendix B)."""
        d, h, L = self.dim, self.hidden_dim, self.n_layers
        matmul = L * (3 * d * d + d * d + 2 * d * h) + self.vocab_size * d
        return 6 * matmul + 12 * L * d * seq_len


FLAVORS: dict[str, GPT2Args] = {
    "debugmodel": GPT2Args(dim=128, n_layers=4, n_heads=8, max_seq_len=512),
    "tiny": GPT2Args(dim=32, n_layers=2, n_heads=4, max_seq_len=256),
    "124M": GPT2Args(dim=768, n_layers=12, n_heads=12, vocab_size=50257, max_seq_len=1024),
    "350M": GPT2Args(dim=1024, n_layers=24, n_heads=16, vocab_size=50257, max_seq_len=1024),
    "774M": GPT2Args(dim=1280, n_layers=36, n_heads=20, vocab_size=50257, max_seq_len=1024),
    "1.5B": GPT2Args(dim=1600, n_layers=48, n_heads=25, vocab_size=50257, max_seq_len=1024),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.c_attn = nn.Linear(args.dim, 3 * args.dim, bias=True)  # q | k | v
        self.c_proj = nn.Linear(args.dim, args.dim, bias=True)
        self.core = AttentionCore()  # the shared attention seam (context parallelism swaps it)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # this rank's heads of each chunk under tensor parallelism
        q, k, v = (t.reshape(bsz, seqlen, -1, self.head_dim) for t in (q, k, v))
        return self.c_proj(self.core(q, k, v, mask).reshape(bsz, seqlen, -1))


class MLP(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.c_fc = nn.Linear(args.dim, args.hidden_dim, bias=True)
        self.c_proj = nn.Linear(args.hidden_dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's "gelu_new"


def param_init(args: GPT2Args) -> Callable[[str], Init]:
    """Every parameter's distribution, by full-model FQN (GPT-2's scheme): N(0, 0.02) for embeddings and the
    projections reading the residual stream, N(0, 0.02 / sqrt(2 n_layers)) for those writing into it (``c_proj``),
    N(0, 0.01) for positions, zero biases, LayerNorm weights one. A tied head is generated as the embedding."""
    emb = normal(0.02)
    return plan_from_patterns(
        {
            r"tok_embeddings\.weight": emb,
            r"pos_embeddings\.weight": normal(0.01),
            r"layers\.\d+\.(ln_1|ln_2)\.weight": ones(),
            r"layers\.\d+\.(ln_1|ln_2)\.bias": zeros(),
            r"layers\.\d+\.(attn\.c_attn|mlp\.c_fc)\.weight": normal(0.02),
            r"layers\.\d+\.(attn|mlp)\.c_proj\.weight": normal(0.02 / math.sqrt(2 * args.n_layers)),
            r"layers\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.bias": zeros(),
            r"norm\.weight": ones(),
            r"norm\.bias": zeros(),
            r"output\.weight": emb.tied_to("tok_embeddings.weight") if args.tie_embeddings else normal(0.02),
        }
    )


class Block(DecoderBlock):
    param_init = staticmethod(param_init)

    def __init__(self, layer_id: int, args: GPT2Args):
        super().__init__(layer_id, args)
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = CausalSelfAttention(args)
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        h = x + self.attn(self.ln_1(x), mask=mask)  # a keyword: the TP plan prepares the positional input only
        return h + self.mlp(self.ln_2(h))


class GPT2(Decoder):
    """GPT-2: ``tok_embeddings`` + ``pos_embeddings`` -> ``layers`` (Block by global index) -> ``norm`` (LayerNorm)
    -> ``output``. A pipeline stage is this module with other stages' modules removed
    (``titanlike.parallel.pipeline.build_stage``): without the embeddings it takes hidden states, without the head it
    returns them."""

    input_modules = ("tok_embeddings", "pos_embeddings")
    param_init = staticmethod(param_init)

    def __init__(self, args: GPT2Args):
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self._build_trunk(lambda i: Block(i, args), nn.LayerNorm(args.dim, eps=args.norm_eps))

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens) + self.pos_embeddings(positions)
