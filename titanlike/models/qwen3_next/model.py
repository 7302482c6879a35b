"""Qwen3-Next in plain ``torch.nn``: a hybrid of Gated DeltaNet layers and gated full-attention layers (every
``full_attention_interval``-th layer full attention, the others linear attention), a mixture of experts with a
sigmoid-gated shared expert in every layer, zero-centred RMSNorms (``x * (1 + w)``, weights initialised at zero).
Shapes as published (Qwen's Qwen3-Next-80B-A3B config.json, transformers' ``Qwen3NextConfig``).

* **Gated DeltaNet** (:class:`GatedDeltaNet`): ``in_proj_qkvz`` and ``in_proj_ba`` fused as transformers stores
  them, grouped by key head (group ``i``: ``q_i | k_i | v_i | z_i`` and ``b_i | a_i``, with ``v_heads / k_heads``
  value heads per group), so a column split over tensor parallelism gives each rank whole groups; a short causal
  depthwise conv (kernel 4) + SiLU on ``q | k | v`` (its channels grouped the same way: the adapter permutes
  transformers' ``[q | k | v]`` order); L2-normalised ``q, k``; ``beta = sigmoid(b)``, the decay
  ``g = -exp(A_log) * softplus(a + dt_bias)``; the gated delta rule through the linear-attention seam
  (``titanlike.models.linear_attention``); a per-head RMSNorm of the output times ``silu(z)``; ``out_proj``.
* **Gated attention** (:class:`GatedAttention`): the query projection gives per head ``q | gate``; QK-norm
  (zero-centred, per head); rotate-half RoPE on the first ``partial_rotary_factor`` of each head; the attention
  output times ``sigmoid(gate)``; grouped kv heads; through the shared attention seam.

Module names: ``tok_embeddings``, ``layers.N.{attention_norm, ffn_norm}``, a linear layer's ``layers.N.linear_attn
.{in_proj_qkvz, in_proj_ba, conv.weight, decay.{A_log, dt_bias}, norm, out_proj}``, a full-attention layer's
``layers.N.attention.{wq, wk, wv, wo, q_norm, k_norm}``, ``layers.N.moe.{router.gate, experts.{w1, w2, w3},
shared_experts.{w1, w2, w3}, shared_gate}`` (a dense layer: ``feed_forward.{w1, w2, w3}``), ``norm``, ``output``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titanlike.init import Init, log_uniform, normal, ones, plan_from_patterns, zeros
from titanlike.models.decoder import AttentionCore, Decoder, DecoderBlock
from titanlike.models.layers import FeedForward, RopeTables, compute_dtype
from titanlike.models.linear_attention import GatedDeltaCore, ShortConvCore, l2norm
from titanlike.models.moe import MoE, MoEArgs, init_moe_buffers
from titanlike.models.qwen3.model import apply_rope_half

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Qwen3NextArgs:
    dim: int = 2048
    n_layers: int = 48
    # gated full attention
    n_heads: int = 16
    n_kv_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25  # RoPE on this fraction of each head's dims
    full_attention_interval: int = 4  # every k-th layer full attention (layers k-1, 2k-1, ...), the others linear
    # Gated DeltaNet
    linear_k_heads: int = 16
    linear_v_heads: int = 32
    linear_k_head_dim: int = 128
    linear_v_head_dim: int = 128
    conv_kernel: int = 4
    linear_chunk_size: int = 64  # the chunked delta rule's chunk (numerics only: every chunk size is exact)
    # feed-forward: MoE with a gated shared expert (num_experts 0: dense SwiGLU of ffn_hidden_dim everywhere)
    ffn_hidden_dim: int = 5632
    moe_hidden_dim: int = 512
    num_experts: int = 512
    top_k: int = 10
    route_norm: bool = True
    shared_hidden_dim: int = 512
    load_balance_coeff: float | None = None  # transformers' Qwen3-Next has no expert bias
    aux_loss_coeff: float = 0.0
    experts_impl: str = "auto"
    vocab_size: int = -1
    norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    max_seq_len: int = 262144
    tie_embeddings: bool = False

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def replace(self, **changes) -> Qwen3NextArgs:
        return dataclasses.replace(self, **changes)

    def layer_type(self, layer_id: int) -> str:
        return "full_attention" if (layer_id + 1) % self.full_attention_interval == 0 else "linear_attention"

    @property
    def n_full_layers(self) -> int:
        return sum(self.layer_type(i) == "full_attention" for i in range(self.n_layers))

    def moe_args(self) -> MoEArgs:
        return MoEArgs(
            dim=self.dim,
            hidden_dim=self.moe_hidden_dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_shared_experts=1,
            shared_hidden_dim=self.shared_hidden_dim,
            shared_gate=True,
            route_norm=self.route_norm,
            load_balance_coeff=self.load_balance_coeff,
            aux_loss_coeff=self.aux_loss_coeff,
            experts_impl=self.experts_impl,
        )

    # ------------------------------------------------------------------ sizes
    @property
    def key_dim(self) -> int:
        return self.linear_k_heads * self.linear_k_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_v_heads * self.linear_v_head_dim

    def _linear_params(self) -> int:
        d, kd, vd, nv = self.dim, self.key_dim, self.value_dim, self.linear_v_heads
        conv = (2 * kd + vd) * self.conv_kernel
        return d * (2 * kd + 2 * vd) + d * 2 * nv + conv + 2 * nv + self.linear_v_head_dim + vd * d

    def _attention_params(self) -> int:
        d, hd = self.dim, self.head_dim
        return 2 * d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d + 2 * hd

    def _params(self, ffn: int, include_embedding: bool) -> int:
        full = self.n_full_layers
        body = full * self._attention_params() + (self.n_layers - full) * self._linear_params()
        body += self.n_layers * (ffn + 2 * self.dim)
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return body + self.dim + head + (self.vocab_size * self.dim if include_embedding else 0)

    def _ffn(self, active: bool) -> int:
        if not self.num_experts:
            return 3 * self.dim * self.ffn_hidden_dim
        return self.moe_args().active_params() if active else self.moe_args().num_params()

    def num_params(self, include_embedding: bool = True) -> int:
        """Every parameter (all experts; the tied head counted once)."""
        return self._params(self._ffn(False), include_embedding)

    def num_active_params(self, include_embedding: bool = True) -> int:
        """The parameters one token uses (router, top-k routed experts, the gated shared expert)."""
        return self._params(self._ffn(True), include_embedding)

    def flops_per_token(self, seq_len: int) -> int:
        """6 x the matmul weights one token uses + 12 x (n_heads x head_dim) x seq_len per full-attention layer
        (PaLM appendix B) + per linear layer the chunked delta rule's state work, 6 x 2 x (v_heads x dk x dv) x 2
        (reading and writing the (dk, dv) state per token, forward and backward), independent of seq_len."""
        d, full = self.dim, self.n_full_layers
        lin = self.n_layers - full
        matmul = full * (self._attention_params() - 2 * self.head_dim)
        matmul += lin * (d * (2 * self.key_dim + 2 * self.value_dim) + d * 2 * self.linear_v_heads + self.value_dim * d)
        matmul += self.n_layers * self._ffn(True) + self.vocab_size * d
        state = 2 * self.linear_v_heads * self.linear_k_head_dim * self.linear_v_head_dim * 2
        return 6 * matmul + 12 * full * self.n_heads * self.head_dim * seq_len + 6 * lin * state


FLAVORS: dict[str, Qwen3NextArgs] = {
    # tiny test shapes: both layer kinds (linear, full), MoE of 8 experts top-2 with the gated shared expert, chunk 8
    "debugmodel": Qwen3NextArgs(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        partial_rotary_factor=0.5,
        full_attention_interval=2,
        linear_k_heads=2,
        linear_v_heads=4,
        linear_k_head_dim=32,
        linear_v_head_dim=32,
        linear_chunk_size=8,
        ffn_hidden_dim=256,
        moe_hidden_dim=64,
        num_experts=8,
        top_k=2,
        shared_hidden_dim=64,
        rope_theta=10000.0,
        max_seq_len=512,
    ),
    # the gate's shape: a linear layer then a full-attention one, 4 experts of 32, chunk 4 (several chunks per piece)
    "tiny": Qwen3NextArgs(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        full_attention_interval=2,
        linear_k_heads=2,
        linear_v_heads=4,
        linear_k_head_dim=8,
        linear_v_head_dim=8,
        linear_chunk_size=4,
        ffn_hidden_dim=64,
        moe_hidden_dim=32,
        num_experts=4,
        top_k=2,
        shared_hidden_dim=32,
        rope_theta=10000.0,
        max_seq_len=256,
    ),
    # Qwen/Qwen3-Next-80B-A3B (config.json): 48 layers, 3 Gated DeltaNet per gated attention, 512 experts top-10
    "80B-A3B": Qwen3NextArgs(vocab_size=151936),
}


def param_init(args: Qwen3NextArgs) -> Callable[[str], Init]:
    """Every parameter's distribution by full-model FQN: transformers' Qwen3-Next init (``initializer_range`` 0.02
    for every projection, the conv, the router, the experts and the embedding; zero-centred norms zeros, the gated
    output norm ones; ``dt_bias`` ones; ``A_log = log(uniform(0.01, 16))``)."""
    std = normal(0.02)
    lin = r"layers\.\d+\.linear_attn\."
    return plan_from_patterns(
        {
            r"tok_embeddings\.weight": std,
            r"layers\.\d+\.(attention_norm|ffn_norm|attention\.q_norm|attention\.k_norm)\.weight": zeros(),
            r"layers\.\d+\.attention\.(wq|wk|wv|wo)\.weight": std,
            lin + r"(in_proj_qkvz|in_proj_ba|out_proj)\.weight": std,
            lin + r"conv\.weight": std,
            lin + r"decay\.A_log": log_uniform(0.01, 16.0),
            lin + r"(decay\.dt_bias|norm\.weight)": ones(),
            r"layers\.\d+\.feed_forward\.(w1|w2|w3)\.weight": std,
            r"layers\.\d+\.moe\.(router\.gate\.weight|experts\.(w1|w2|w3)|shared_experts\.(w1|w2|w3)\.weight)": std,
            r"layers\.\d+\.moe\.shared_gate\.weight": std,
            r"norm\.weight": zeros(),
            r"output\.weight": std.tied_to("tok_embeddings.weight") if args.tie_embeddings else std,
        }
    )


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + w`` (weights start at zero), computed in at least float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        h = x.to(dtype)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(dtype))).type_as(x)


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet output norm over each head's ``dv`` dims: ``w * rmsnorm(x)`` (weights start at one); the
    layer multiplies by ``silu(z)``. A norm over each rank's own heads under tensor parallelism (``HeadNorm``)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.type_as(x)


class ShortConv(nn.Module):
    """The depthwise conv's weight ``(channels, kernel)``: ``forward(taps)`` = ``(taps * weight).sum(-1)`` over the
    seam's taps (``titanlike.models.linear_attention.ShortConvCore``). Its channels go with their heads over tp."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))

    def forward(self, taps: torch.Tensor) -> torch.Tensor:
        return (taps * self.weight.to(taps.dtype)).sum(-1)


class DeltaDecay(nn.Module):
    """Per value head ``A_log``, ``dt_bias``: ``forward(b, a)`` -> ``beta = sigmoid(b)``, ``g = -exp(A_log) *
    softplus(a + dt_bias)`` (at least float32). Its parameters go with their heads over tp."""

    def __init__(self, heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.ones(heads))

    def forward(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = compute_dtype(a)
        g = -self.A_log.to(dtype).exp() * F.softplus(a.to(dtype) + self.dt_bias.to(dtype))
        return b.sigmoid(), g


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer (module docstring). ``forward(x, mask=None, **kwargs)`` (RoPE rows ignored)."""

    def __init__(self, args: Qwen3NextArgs):
        super().__init__()
        self.dk, self.dv = args.linear_k_head_dim, args.linear_v_head_dim
        self.rep = args.linear_v_heads // args.linear_k_heads  # value heads per key head
        self.kernel = args.conv_kernel
        nk, group = args.linear_k_heads, 2 * self.dk + 2 * self.rep * self.dv
        self.in_proj_qkvz = nn.Linear(args.dim, nk * group, bias=False)
        self.in_proj_ba = nn.Linear(args.dim, nk * 2 * self.rep, bias=False)
        self.conv = ShortConv(nk * (2 * self.dk + self.rep * self.dv), args.conv_kernel)
        self.conv_core = ShortConvCore()
        self.decay = DeltaDecay(args.linear_v_heads)
        self.core = GatedDeltaCore(args.linear_chunk_size)
        self.norm = GatedRMSNorm(self.dv, args.norm_eps)
        self.out_proj = nn.Linear(args.value_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, mask=None, **kwargs) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        dk, dv, rep = self.dk, self.dv, self.rep
        # -1: the key-head groups this module holds (all, or this rank's under tensor parallelism)
        qkv, z = (
            self.in_proj_qkvz(x)
            .view(bsz, seqlen, -1, 2 * dk + 2 * rep * dv)
            .split([2 * dk + rep * dv, rep * dv], dim=-1)
        )
        # sliced, not split: split's backward concatenates the two gradients, which arrive here channels-last
        # strided (transposed by the delta rule) and keep that layout through the concatenation, whose following
        # view then fails in a compiled backward (torch 2.13 traces the concatenation contiguous)
        ba = self.in_proj_ba(x).view(bsz, seqlen, -1, 2 * rep)
        b, a = ba[..., :rep], ba[..., rep:]
        taps = self.conv_core(qkv.reshape(bsz, seqlen, -1), self.kernel, mask)
        mixed = F.silu(self.conv(taps)).view(bsz, seqlen, -1, 2 * dk + rep * dv)
        q, k, v = mixed.split([dk, dk, rep * dv], dim=-1)
        dtype = compute_dtype(x)
        q, k = l2norm(q.to(dtype)), l2norm(k.to(dtype))
        beta, g = self.decay(b.reshape(bsz, seqlen, -1), a.reshape(bsz, seqlen, -1))
        out = self.core(q, k, v.reshape(bsz, seqlen, -1, dv), g, beta, mask)
        out = self.norm(out) * F.silu(z.reshape(bsz, seqlen, -1, dv).to(dtype))
        return self.out_proj(out.type_as(x).reshape(bsz, seqlen, -1))


def apply_rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``2 * cos.shape[-1]`` dims of each head, the rest passed through."""
    rd = 2 * cos.shape[-1]
    return torch.cat([apply_rope_half(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate from the query projection (per head ``q | gate``), QK-norm and
    partial rotate-half RoPE, through the shared attention seam."""

    def __init__(self, args: Qwen3NextArgs):
        super().__init__()
        self.head_dim = hd = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * hd * 2, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.q_norm = ZeroCentredRMSNorm(hd, args.norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, args.norm_eps)
        self.sdpa = AttentionCore()

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        hd = self.head_dim
        q, gate = self.wq(x).view(bsz, seqlen, -1, 2 * hd).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.wk(x).view(bsz, seqlen, -1, hd))
        v = self.wv(x).view(bsz, seqlen, -1, hd)
        q, k = apply_rope_partial(q, cos, sin), apply_rope_partial(k, cos, sin)
        out = self.sdpa(q, k, v, mask).reshape(bsz, seqlen, -1)
        return self.wo(out * torch.sigmoid(gate.reshape(bsz, seqlen, -1)))


class Qwen3NextBlock(DecoderBlock):
    """``h = x + mixer(attention_norm(x))`` (``linear_attn`` or ``attention`` by the layer's type), then
    ``h + moe(ffn_norm(h))`` (a dense SwiGLU ``feed_forward`` when the model has no experts)."""

    param_init = staticmethod(param_init)

    def __init__(self, layer_id: int, args: Qwen3NextArgs):
        super().__init__(layer_id, args)
        self.attention_norm = ZeroCentredRMSNorm(args.dim, args.norm_eps)
        if args.layer_type(layer_id) == "full_attention":
            self.attention = GatedAttention(args)
        else:
            self.linear_attn = GatedDeltaNet(args)
        self.ffn_norm = ZeroCentredRMSNorm(args.dim, args.norm_eps)
        if args.num_experts:
            self.moe = MoE(args.moe_args())
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        mixer = self.attention if hasattr(self, "attention") else self.linear_attn
        h = x + mixer(self.attention_norm(x), **kwargs)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Qwen3Next(RopeTables, Decoder):
    """``tok_embeddings`` -> ``layers`` (Qwen3NextBlock by global index) -> ``norm`` -> ``output``; RoPE tables of
    the rotated dims as root buffers."""

    param_init = staticmethod(param_init)

    def __init__(self, args: Qwen3NextArgs):
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self._build_trunk(lambda i: Qwen3NextBlock(i, args), ZeroCentredRMSNorm(args.dim, args.norm_eps))
        self._register_rope()

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        super().init_buffers(device)
        init_moe_buffers(self, device)
