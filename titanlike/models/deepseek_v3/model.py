"""DeepSeek-V3 in plain ``torch.nn`` (arXiv 2412.19437; DeepSeek-V2-Lite / Moonlight share the shape): multi-head
latent attention (MLA), DeepSeek's mixture of experts (``titanlike.models.moe``: sigmoid scores, the correction bias
for selection only, group-limited top-k, shared experts, the first ``n_dense_layers`` layers dense) and optional
multi-token prediction (MTP, §2.2).

**MLA** (:class:`MLA`): queries through a low-rank path (``wq_a`` -> ``q_norm`` RMSNorm -> ``wq_b`` to the heads;
``q_lora_rank = 0``: one plain ``wq``), keys and values from one down-projection ``wkv_a`` to the compressed latent
(``kv_lora_rank``) and the decoupled RoPE key (``qk_rope_head_dim``, shared by every head), the latent's RMSNorm
``kv_norm``, and the up-projection ``wkv_b`` to per-head ``qk_nope_head_dim`` keys and ``v_head_dim`` values. RoPE
turns the rope part only: DeepSeek's interleaved pairs (``rope_interleave``, its checkpoints) or Hugging Face's
rotate-half layout. The softmax scale is ``qk_head_dim ** -0.5`` times YaRN's ``mscale(factor, mscale_all_dim) ** 2``
(transformers' ``yarn_apply_mscale``); it is folded into the queries (``q * scale * sqrt(qk_head_dim)``) so the
shared attention seam keeps its default ``1 / sqrt(head_dim)`` and every seam that replaces it (context parallelism,
the block-causal mask) applies unchanged. YaRN's frequencies and table factor come from the one shared place
(``titanlike.models.layers.rope_tables``).

**MTP** (:class:`MTPModule`, ``mtp_layers`` = D): depth k combines the previous depth's hidden state (depth 1: the
main model's, after its final norm, as transformers' and vLLM's MTP take it) with the embedding of the token k
positions ahead: ``eh_proj([enorm(emb(t_{i+k})); hnorm(h_i)])``, one transformer block, then ``norm`` and the shared
head (``output``); the next depth takes the block's output. The token ids ahead come from the window itself (the
window seam ``SequenceWindow``: under context parallelism the cp ranks' ids gathered), as Megatron-Core rolls them:
the last k positions of a window have no depth-k target. In training mode the forward
returns ``(logits, depth-1 logits, ..., depth-D logits)``; ``titanlike.loss.ScaledLoss`` turns them into the
next-token loss plus ``mtp_loss_weight / D`` times the depth losses (each against the labels shifted by k), the
value it returns staying the next-token loss. In eval mode the forward returns the logits only.

Module names (torchtitan's): ``tok_embeddings``, ``layers.N.{attention_norm, attention.{wq | wq_a, q_norm, wq_b},
attention.{wkv_a, kv_norm, wkv_b, k_rope, wo}, ffn_norm, feed_forward.{w1, w2, w3} | moe.{router.gate, experts,
shared_experts}}``, ``norm``, ``output``, ``mtp.K.{embed (tied to tok_embeddings), enorm, hnorm, eh_proj,
block.<a layer's names>, norm}``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titanlike.init import Init, normal, ones, plan_from_patterns
from titanlike.models.decoder import Decoder, LatentAttentionCore, SequenceWindow
from titanlike.models.layers import RMSNorm, RopeTables, apply_rope, yarn_mscale
from titanlike.models.masking import DocumentMask
from titanlike.models.moe import MoEArgs, MoEDecoderBlock, init_moe_buffers
from titanlike.models.qwen3 import apply_rope_half

__all__ = ["FLAVORS", "MLA", "DeepseekV3", "DeepseekV3Args", "DeepseekV3Block", "MTPModule", "param_init"]


@dataclass
class DeepseekV3Args:
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    vocab_size: int = -1  # set from the tokenizer
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    # multi-head latent attention
    q_lora_rank: int = 1536  # 0: one plain query projection (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # DeepSeek's checkpoints: interleaved pairs; False: rotate-half
    # RoPE scaling (titanlike.models.layers.rope_inv_freq): "none" or "yarn" with its fields
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_original_max_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float = 0.0
    rope_truncate: bool = True
    # the dense layers and the mixture of experts
    ffn_hidden_dim: int = 18432  # the first n_dense_layers layers' SwiGLU width (intermediate_size)
    n_dense_layers: int = 3  # first_k_dense_replace
    moe_hidden_dim: int = 2048  # per routed expert (moe_intermediate_size)
    num_experts: int = 256
    top_k: int = 8
    num_shared_experts: int = 1
    score_func: str = "sigmoid"
    route_norm: bool = True  # norm_topk_prob
    route_scale: float = 2.5  # routed_scaling_factor
    num_groups: int = 8  # n_group
    topk_groups: int = 4  # topk_group
    load_balance_coeff: float | None = 1e-3  # the correction bias's update speed (None: no bias)
    aux_loss_coeff: float = 0.0  # the sequence-wise auxiliary loss (DeepSeek-V3: 1e-4)
    experts_impl: str = "auto"
    # multi-token prediction depths (0: off)
    mtp_layers: int = 0

    # --------------------------------------------------------------------------- derived shapes
    @property
    def n_kv_heads(self) -> int:  # every head its own key and value (expanded from the latent)
        return self.n_heads

    @property
    def head_dim(self) -> int:  # the rotated dims: what the RoPE tables cover
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN (transformers'
        ``yarn_apply_mscale``; DeepSeek-V3's reference ``softmax_scale``)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling == "yarn" and self.rope_mscale_all_dim:
            scale *= yarn_mscale(self.rope_scaling_factor, self.rope_mscale_all_dim) ** 2
        return scale

    @property
    def cp_gathered(self) -> list[tuple[str, int]]:
        """What context parallelism all-gathers per token and block (the planner prices it): the latent and the
        shared RoPE key (``ContextParallelLatentAttention``; 512 + 64 for V3)."""
        return [("MLA latent", self.kv_lora_rank), ("MLA shared RoPE key", self.qk_rope_head_dim)]

    @property
    def cp_per_head_numbers(self) -> int:
        """What gathering the expanded per-head keys and values would move per token (2 x 128 x 192 for V3: k is
        qk_head_dim wide, v v_head_dim)."""
        return self.n_heads * (self.qk_head_dim + self.v_head_dim)

    def replace(self, **changes) -> DeepseekV3Args:
        return dataclasses.replace(self, **changes)

    def moe_args(self) -> MoEArgs:
        return MoEArgs(
            dim=self.dim,
            hidden_dim=self.moe_hidden_dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_shared_experts=self.num_shared_experts,
            score_func=self.score_func,
            route_norm=self.route_norm,
            route_scale=self.route_scale,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            load_balance_coeff=self.load_balance_coeff,
            aux_loss_coeff=self.aux_loss_coeff,
            experts_impl=self.experts_impl,
        )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` holds experts (MTP blocks, ``layer_id >= n_layers``, as the last layer)."""
        return layer_id >= self.n_dense_layers and self.num_experts > 0

    @property
    def n_moe_layers(self) -> int:
        return max(self.n_layers - self.n_dense_layers, 0)

    # --------------------------------------------------------------------------- counts
    def attention_params(self) -> int:
        """One MLA block's parameters (projections and the q / latent norms)."""
        d, h = self.dim, self.n_heads
        q = d * h * self.qk_head_dim if not self.q_lora_rank else (d + h * self.qk_head_dim + 1) * self.q_lora_rank
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d

    def _block_params(self, layer_id: int, active: bool) -> int:
        m = self.moe_args()
        ffn = (m.active_params() if active else m.num_params()) if self.is_moe_layer(layer_id) else None
        return self.attention_params() + 2 * self.dim + (3 * self.dim * self.ffn_hidden_dim if ffn is None else ffn)

    def _params(self, active: bool, include_embedding: bool, mtp: bool = True) -> int:
        d = self.dim
        body = sum(self._block_params(i, active) for i in range(self.n_layers))
        if mtp:  # each depth: two norms, eh_proj, a block, its norm (the embedding and head are the model's)
            depths = range(self.n_layers, self.n_layers + self.mtp_layers)
            body += sum(3 * d + 2 * d * d + self._block_params(i, active) for i in depths)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return body + d + head + (self.vocab_size * d if include_embedding else 0)

    def num_params(self, include_embedding: bool = True) -> int:
        """Every parameter (all experts, the MTP modules; a tied head counted once)."""
        return self._params(False, include_embedding)

    def num_active_params(self, include_embedding: bool = True) -> int:
        """The parameters one token uses in the main model: router, ``top_k`` routed and the shared experts."""
        return self._params(True, include_embedding, mtp=False)

    def attention_flops_per_token(self, seq_len: int) -> int:
        """Forward + backward FLOPs of one MLA block's scores and weighted values per token (PaLM's 12 L h d s, with
        q / k ``qk_head_dim`` and v ``v_head_dim`` wide: 6 h (d_qk + d_v) s)."""
        return 6 * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len

    def flops_per_token(self, seq_len: int) -> int:
        """6 x the matmul weights one token uses (active experts, the head) + the attention of every block, MTP
        depths included (each runs a block, ``eh_proj`` and the head once more per token)."""
        d = self.dim
        blocks = list(range(self.n_layers + self.mtp_layers))
        matmul = sum(self._block_params(i, True) - 2 * d for i in blocks)
        matmul -= len(blocks) * (self.kv_lora_rank + (self.q_lora_rank and 1) * self.q_lora_rank)  # their norms
        matmul += self.mtp_layers * 2 * d * d + (1 + self.mtp_layers) * self.vocab_size * d
        return 6 * matmul + len(blocks) * self.attention_flops_per_token(seq_len)


def param_init(args: DeepseekV3Args) -> Callable[[str], Init]:
    """Every parameter's distribution by full-model FQN: transformers' DeepSeek-V3 init (``initializer_range`` 0.02
    for every projection, the router and every expert, each expert generated on its own), norms ones."""
    w = normal(0.02)
    block = r"(layers\.\d+|mtp\.\d+\.block)\."
    return plan_from_patterns(
        {
            r"tok_embeddings\.weight": w,
            block + r"(attention_norm|ffn_norm|attention\.q_norm|attention\.kv_norm)\.weight": ones(),
            block + r"attention\.(wq|wq_a|wq_b|wkv_a|wkv_b|wo)\.weight": w,
            block + r"feed_forward\.(w1|w2|w3)\.weight": w,
            block + r"moe\.(router\.gate\.weight|experts\.(w1|w2|w3)|shared_experts\.(w1|w2|w3)\.weight)": w,
            r"mtp\.\d+\.(enorm|hnorm|norm)\.weight": ones(),
            r"mtp\.\d+\.eh_proj\.weight": w,
            r"mtp\.\d+\.embed\.weight": w.tied_to("tok_embeddings.weight"),
            r"norm\.weight": ones(),
            r"output\.weight": w.tied_to("tok_embeddings.weight") if args.tie_embeddings else w,
        }
    )


class SharedKey(nn.Module):
    """The decoupled RoPE key, shared by every head: an identity here; a named module so that tensor parallelism can
    hand the per-head part of the attention its local tensor (``titanlike.sharding.Latent(local_output=True)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class MLA(nn.Module):
    """Multi-head latent attention (module docstring); ``forward(x, *, cos, sin, mask=None)``; heads inferred from
    the up-projections' shapes, so column-sharded ``wq_b`` / ``wkv_b`` give each rank fewer heads."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        a = self.args = args
        qk = a.qk_head_dim
        if a.q_lora_rank:
            self.wq_a = nn.Linear(a.dim, a.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(a.q_lora_rank, a.norm_eps)
            self.wq_b = nn.Linear(a.q_lora_rank, a.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(a.dim, a.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(a.dim, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(a.kv_lora_rank, a.norm_eps)
        self.wkv_b = nn.Linear(a.kv_lora_rank, a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.k_rope = SharedKey()
        self.wo = nn.Linear(a.n_heads * a.v_head_dim, a.dim, bias=False)
        self.core = LatentAttentionCore()  # the attention seam: context parallelism gathers the latent
        # the seam's default scale is 1 / sqrt(q's head dim): fold the model's softmax scale into q
        self.q_scale = a.softmax_scale * math.sqrt(qk)
        self.rope = apply_rope if a.rope_interleave else apply_rope_half

    def forward(self, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        a = self.args
        b, s, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if a.q_lora_rank else self.wq(x)
        q_nope, q_pe = q.view(b, s, -1, a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.wkv_a(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        k_pe = self.rope(self.k_rope(k_pe).unsqueeze(2), cos, sin)  # (b, s, 1, rope): one key for every head
        q = torch.cat([q_nope, self.rope(q_pe, cos, sin)], dim=-1) * self.q_scale
        return self.wo(self.core(q, self.kv_norm(latent), k_pe, self.expand, mask).reshape(b, s, -1))

    def expand(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed latent (b, s, kv_lora_rank) and the rotated shared key (b, s, 1, rope) -> per-head keys
        ``[k_nope | k_pe]`` and values (the seam calls it: under context parallelism on the gathered sequence)."""
        a = self.args
        kv = self.wkv_b(latent).view(*latent.shape[:2], -1, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        return torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1), v


class DeepseekV3Block(MoEDecoderBlock):
    """``h = x + attention(attention_norm(x))``, then ``h + ffn(ffn_norm(h))``: a SwiGLU ``feed_forward`` in the
    first ``n_dense_layers`` layers, the ``moe`` block after."""

    param_init = staticmethod(param_init)
    attention_class = MLA


class MTPModule(nn.Module):
    """One MTP depth: ``block(eh_proj([enorm(embed(t)); hnorm(h)]))``; ``embed`` is the model's token table (tied:
    one parameter, a copy on the last pipeline stage whose gradient the pipeline sums with the first stage's);
    ``norm`` is the norm before the shared head (DeepSeek's checkpoints: ``shared_head.norm``)."""

    def __init__(self, depth: int, args: DeepseekV3Args):
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, args.dim)  # the model ties it to tok_embeddings
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = DeepseekV3Block(args.n_layers + depth - 1, args)
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, tokens: torch.Tensor, h: torch.Tensor, **kwargs) -> torch.Tensor:
        emb = self.embed(tokens)
        return self.block(self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)), **kwargs)


def tokens_ahead(window: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """The token ids ``k`` ahead of the tokens at ``positions`` (seq,) in the whole ``window`` (batch, seq of the
    window); past the window's end the last token (those positions' targets are ignored)."""
    return window[:, (positions + k).clamp(max=window.shape[1] - 1)]


class DeepseekV3(RopeTables, Decoder):
    """``tok_embeddings`` -> ``layers`` (DeepseekV3Block by global index) -> ``norm`` -> ``output``, and the MTP
    depths ``mtp`` (an output module: on the last pipeline stage); RoPE tables as root buffers (of the rope part),
    the expert biases and load counters as the MoE blocks' buffers."""

    param_init = staticmethod(param_init)
    output_modules = ("norm", "output", "mtp")

    def __init__(self, args: DeepseekV3Args):
        super().__init__(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self._build_trunk(lambda i: DeepseekV3Block(i, args), RMSNorm(args.dim, args.norm_eps))
        self.mtp = nn.ModuleDict({str(k): MTPModule(k, args) for k in range(1, args.mtp_layers + 1)})
        for depth in self.mtp.values():
            depth.embed.weight = self.tok_embeddings.weight
        self.window = SequenceWindow()  # the whole window's token ids (cp: gathered), for the tokens ahead
        self._register_rope()

    @property
    def wants_token_ids(self) -> bool:
        """Whether every pipeline stage must get the batch's token ids (``token_ids``): the MTP depths on the last
        stage embed the tokens ahead (``titanlike.training.step`` passes them)."""
        return self.args.mtp_layers > 0

    def forward(
        self, x: torch.Tensor, document_starts: torch.Tensor | None = None, token_ids: torch.Tensor | None = None
    ):
        """Token ids (or a stage's hidden states) -> logits (or hidden states); in training mode with MTP depths,
        ``(logits, depth-1 logits, ...)`` (a last pipeline stage: from ``token_ids``, the batch's ids)."""
        if not (self.training and self.mtp is not None and len(self.mtp) and self.output is not None):
            return super().forward(x, document_starts)
        inputs = self._has_inputs()
        tokens = x if inputs else token_ids
        if tokens is None:
            raise ValueError("DeepseekV3: the MTP depths of a last pipeline stage need the batch's token_ids")
        positions = window_positions = self.positions(x)
        kwargs = {}
        if document_starts is not None:
            kwargs["mask"] = DocumentMask(document_starts, positions)
            if self.reset_position_ids:
                positions = positions - document_starts
        h = self.embed(x, positions) if inputs else x
        kwargs.update(self.block_kwargs(positions))
        for block in self.layers.values():
            h = block(h, **kwargs)
        h = self.norm(h)
        outs, window = [self.output(h)], self.window(tokens)
        for k, depth in self.mtp.items():
            h = depth(tokens_ahead(window, window_positions, int(k)), h, **kwargs)
            outs.append(self.output(depth.norm(h)))
        return tuple(outs)

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """The RoPE tables, and every MoE block's expert bias (zeros) and load counter."""
        super().init_buffers(device)
        init_moe_buffers(self, device)


_DEBUG = dict(
    dim=64,
    n_layers=3,
    n_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    ffn_hidden_dim=128,
    n_dense_layers=1,
    moe_hidden_dim=32,
    num_experts=8,
    top_k=2,
    num_shared_experts=1,
    num_groups=4,
    topk_groups=2,
    route_scale=2.5,
    load_balance_coeff=1e-2,
    mtp_layers=1,
    max_seq_len=512,
)
FLAVORS: dict[str, DeepseekV3Args] = {
    # tiny test shapes: MLA with the q low-rank path, a dense first layer then MoE (sigmoid, bias, 4 groups /
    # top-2), one MTP depth
    "debugmodel": DeepseekV3Args(**_DEBUG),
    # the gates' shape: the same with 2 layers (dense, MoE) and the MTP depth's block MoE
    "tiny": DeepseekV3Args(**{**_DEBUG, "n_layers": 2, "max_seq_len": 256}),
    # the same with one plain query projection (q_lora_rank 0, as DeepSeek-V2-Lite) and rotate-half RoPE
    "debugmodel_lite": DeepseekV3Args(**{**_DEBUG, "q_lora_rank": 0, "rope_interleave": False}),
    # DeepSeek-V2-Lite / Moonlight shape (torchtitan's 16B): 64 experts, top-6, 2 shared, softmax, no MTP
    "16B": DeepseekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        q_lora_rank=0,
        ffn_hidden_dim=10944,
        n_dense_layers=1,
        moe_hidden_dim=1408,
        num_experts=64,
        top_k=6,
        num_shared_experts=2,
        score_func="softmax",
        route_norm=False,
        route_scale=1.0,
        num_groups=1,
        topk_groups=1,
        vocab_size=102400,
        max_seq_len=4096,
    ),
    # DeepSeek-V3 / R1 (config.json of deepseek-ai/DeepSeek-V3): YaRN x40 over 4096, one MTP depth
    "671B": DeepseekV3Args(
        vocab_size=129280,
        max_seq_len=163840,
        rope_scaling="yarn",
        rope_scaling_factor=40.0,
        rope_original_max_seq_len=4096,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        mtp_layers=1,
    ),
}
