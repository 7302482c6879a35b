"""A nanoGPT-style GPT written the way an outside user writes it: its own names (wte, wpe, h, ln_f, lm_head, c_attn),
a fused q|k|v Linear with bias, tied embeddings, no titanlike import. The one concession to pipelining is
torchtitan's contract: forward skips modules that are None (a stage without the embeddings takes hidden states,
one without the head returns them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.head_dim = d // n_head

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), SelfAttention(d, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(d), FeedForward(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 128, block_size: int = 16, d: int = 32, n_head: int = 4, n_layer: int = 4):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.h = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx):
        if self.wte is not None:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        else:
            x = idx
        for block in self.h:
            x = block(x)
        if self.lm_head is None:
            return x
        return self.lm_head(self.ln_f(x))


def tp_plan(module: nn.Module) -> dict:
    """The user's tensor-parallel plan for the parts of NanoGPT that ``module`` (a stage) holds: plain tensors
    between blocks (every style returns local tensors), vocab-sharded embedding, fused c_attn, replicated norms."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    from titanlike.parallel import ReplicateParallel
    from titanlike.parallel.fused import FusedColwiseParallel

    f = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    plan = {}
    if module.wte is not None:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate())
        plan["wpe"] = ReplicateParallel()
    for i in module.h._modules:
        plan.update({f"h.{i}.ln_1": ReplicateParallel(), f"h.{i}.ln_2": ReplicateParallel(), f"h.{i}.attn": f,
                     f"h.{i}.mlp": f, f"h.{i}.attn.c_attn": FusedColwiseParallel(3),
                     f"h.{i}.attn.c_proj": RowwiseParallel(), f"h.{i}.mlp.c_fc": ColwiseParallel(),
                     f"h.{i}.mlp.c_proj": RowwiseParallel()})
    if module.lm_head is not None:
        plan["ln_f"] = ReplicateParallel()
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan
