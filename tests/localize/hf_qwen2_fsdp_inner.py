"""Issue 26's coverage trap reproduced by hand: Qwen2ForCausalLM (q/k/v biases, its own head) with FSDP on the
inner decoder only (``apply_fsdp(model.model, ...)``: it has ``.layers``), the head left outside, on 2
data-parallel ranks. train_step refuses this at its first step; this file's own loop has no such check."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from titanlike.parallel import apply_fsdp

MESH = {"dp": 2}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def build():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**TINY, num_key_value_heads=2, tie_word_embeddings=False))


def parallelize(model, mesh):
    apply_fsdp(model.model, mesh["dp"])
    return model


def batch(step: int):
    tokens = torch.randint(64, (4, 17), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]
