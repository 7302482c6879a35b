"""A nanoGPT-style GPT (no titanlike import) trained under pipeline x FSDP x tensor (+ sequence) parallelism.

    torchrun --nproc-per-node 8 examples/nanogpt_parallel.py --steps 3 --checkpoint /tmp/nanogpt-ckpt

8 CPU ranks (gloo): pp 2 (1F1B) x dp 2 (FSDP) x tp 2 (TP + SP, fused c_attn, vocab-parallel loss), gradient clipping,
a checkpoint saved, then loaded into a freshly built model that trains one more step. float64, so that
tests/examples/test_nanogpt_example.py can compare every loss, gradient and weight with one process (<= 1e-10).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from titanlike.checkpoint import load_parts, save_parts
from titanlike.parallel import (
    FusedColwiseParallel,
    PositionEmbeddingParallel,
    apply_fsdp,
    apply_tp,
    loss_parallel_cross_entropy,
    pipeline_module,
)
from titanlike.training.step import train_step


# ------------------------------------------------------------------------------------------------ the user's model
@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q | k | v in one matmul, with bias
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.head_dim = config.n_embd // config.n_head

    def forward(self, x):
        B, T, _ = x.shape
        # Heads from the shape (-1), not from n_head: under TP this rank holds n_head / tp of them.
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx):
        # Pipeline stages are this module with some children set to None (torchtitan's contract): a stage without
        # the embeddings takes hidden states, one without the head returns them.
        if self.wte is not None:
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        else:
            x = idx
        for block in self.h:
            x = block(x)
        if self.lm_head is None:
            return x
        return self.lm_head(self.ln_f(x))


# ------------------------------------------------------------------------------------------------ parallelize it
SPLIT = [["wte", "wpe", "h.0", "h.1"], ["h.2", "h.3", "ln_f", "lm_head"]]  # module FQNs per pipeline stage


def tp_plan(stage: GPT) -> dict:
    """Megatron TP + SP for the modules this stage holds. The residual stream is this rank's sequence shard as a
    plain tensor (every style returns local tensors), so stages pass plain tensors; the logits stay a vocab-sharded
    DTensor for the vocab-parallel loss."""
    plan = {}
    if stage.wte is not None:
        plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        plan["wpe"] = PositionEmbeddingParallel(sequence_parallel=True, use_local_output=True)
    for i in stage.h._modules:  # the block indices this stage keeps
        plan.update(
            {
                f"h.{i}.ln_1": SequenceParallel(use_local_output=True),
                f"h.{i}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                f"h.{i}.attn.c_attn": FusedColwiseParallel(3),  # each rank its heads of q, of k and of v
                f"h.{i}.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                f"h.{i}.ln_2": SequenceParallel(use_local_output=True),
                f"h.{i}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                f"h.{i}.mlp.c_fc": ColwiseParallel(),
                f"h.{i}.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
    if stage.lm_head is not None:
        plan["ln_f"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return plan


def sum_cross_entropy(logits, labels):
    """Sum over the tokens; the trainer's loss divides by the global token count (a mean over the global batch)."""
    return loss_parallel_cross_entropy(logits, labels, reduction="sum")


def parallelize(model: GPT, mesh, n_microbatches: int):
    """This rank's pipeline stages of ``model``, each tensor-parallel over ``mesh["tp"]`` and FSDP over
    ``mesh["dp"]``, run by a 1F1B schedule."""

    def parallelize_stage(stage, is_first, is_last):
        apply_tp(stage, mesh["tp"], tp_plan(stage))
        return apply_fsdp(stage, mesh["dp"], blocks=list(stage.h), pp_enabled=True)

    return pipeline_module(
        model,
        mesh["pp"],
        SPLIT,
        loss_fn=sum_cross_entropy,
        n_microbatches=n_microbatches,
        schedule="1F1B",
        parallelize_stage=parallelize_stage,
    )


# ------------------------------------------------------------------------------------------------ train
GLOBAL_BATCH, LR, MAX_NORM = 8, 1e-2, 0.5


def batch(step: int, config: GPTConfig):
    """The global batch of ``step`` (random tokens; a real job reads its data loader)."""
    tokens = torch.randint(
        config.vocab_size, (GLOBAL_BATCH, config.block_size + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1], tokens[:, 1:]


def train(pp, optimizer, mesh, step: int, config: GPTConfig):
    """One AdamW step of the global batch: this dp rank's rows, in microbatches through the pipeline, the gradient
    norm over every stage and mesh dim, clipped to MAX_NORM."""
    inputs, labels = batch(step, config)
    dp = mesh["dp"]
    rows = GLOBAL_BATCH // dp.size()
    mine = slice(dp.get_local_rank() * rows, (dp.get_local_rank() + 1) * rows)
    return train_step(
        pp.model_parts,
        optimizer,
        [(inputs[mine], labels[mine])],
        pp.loss,
        max_norm=MAX_NORM,
        clip_fn=pp.finalize_grads_and_clip_,
        dp_group=dp.get_group(),
        pp_schedule=pp.schedule,
        pp_group=pp.pp_group,
        has_last_stage=pp.has_last_stage,
    )


def build(config: GPTConfig, mesh, seed: int):
    torch.manual_seed(seed)
    model = GPT(config).to(torch.float64)
    pp = parallelize(model, mesh, n_microbatches=2)
    optimizer = torch.optim.AdamW([p for part in pp.model_parts for p in part.parameters()], lr=LR)
    return pp, optimizer


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpoint", default=None, help="checkpoint folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    config = GPTConfig()
    pp, optimizer = build(config, mesh, seed=0)
    results = [train(pp, optimizer, mesh, step, config) for step in range(args.steps)]
    folder = args.checkpoint or tempfile.mkdtemp(prefix="nanogpt-ckpt-")
    save_parts(folder, pp.model_parts, optimizer)
    # Resume: a model built with other weights, then the checkpoint's weights and AdamW state loaded into it.
    resumed, resumed_optimizer = build(config, mesh, seed=1)
    load_parts(folder, resumed.model_parts, resumed_optimizer)
    results.append(train(resumed, resumed_optimizer, mesh, args.steps, config))
    if dist.get_rank() == 0:
        for step, r in enumerate(results):
            print(f"step {step}: loss {r.loss:.6f} grad norm {r.grad_norm:.6f}")
    return {"pp": pp, "resumed": resumed, "results": results, "checkpoint": folder, "config": config}


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
