"""A small decoder written the way an outside user writes one (its own names, keyword calls, a fused q|k|v Linear
with bias, biased projections, LayerNorm, GELU, untied head), with its tensor-parallel plan: the right one, as a
``--module`` file of ``python -m titanlike.localize``.

    python -m titanlike.localize --nproc 2 --module tests/localize/user_decoder.py
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titanlike.parallel import FusedColwiseParallel

MESH = {"tp": 2}
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 2, 8, 4


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)  # q | k | v in one matmul, with bias
        self.o_proj = nn.Linear(dim, dim)
        self.head_dim = dim // heads

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).chunk(3, dim=-1)
        q, k, v = (x.view(b, t, -1, self.head_dim).transpose(1, 2) for x in (q, k, v))  # heads from the shape
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, hidden_states):
        h = hidden_states + self.attn(hidden_states=self.norm1(hidden_states))
        return h + self.mlp(x=self.norm2(h))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(hidden_states=h)
        return self.lm_head(self.norm(h))


def build():
    torch.manual_seed(0)
    return Decoder()


def block_plan(o_proj=None) -> dict:
    """The plan of one block: fused q|k|v by heads, o_proj row-wise (all-reduce), the MLP column- then row-wise."""
    return {
        "attn.qkv": FusedColwiseParallel(3),
        "attn.o_proj": o_proj if o_proj is not None else RowwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(),
    }


def parallelize_with(model, mesh, plan: dict):
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
    return model


def parallelize(model, mesh):
    return parallelize_with(model, mesh, block_plan())


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
