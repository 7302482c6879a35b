"""A nanoGPT-style GPT written the way an outside user writes it: its own names (wte, wpe, h, ln_f, lm_head, c_attn),
a fused q|k|v Linear with bias, tied embeddings, no titanlike import: the README example's module
(examples/nanogpt_parallel.py), with a second TP plan of its own (no sequence parallelism, plain tensors between
blocks). The one concession to pipelining is torchtitan's contract: forward skips modules that are None (a stage
without the embeddings takes hidden states, one without the head returns them)."""

from __future__ import annotations

from torch import nn


def NanoGPT(vocab: int = 128, block_size: int = 16, d: int = 32, n_head: int = 4, n_layer: int = 4) -> nn.Module:
    """The README example's GPT (examples/nanogpt_parallel.py), sized for the pipeline gate."""
    from nanogpt_parallel import GPT, GPTConfig

    return GPT(GPTConfig(block_size=block_size, vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_embd=d))


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
        plan.update(
            {
                f"h.{i}.ln_1": ReplicateParallel(),
                f"h.{i}.ln_2": ReplicateParallel(),
                f"h.{i}.attn": f,
                f"h.{i}.mlp": f,
                f"h.{i}.attn.c_attn": FusedColwiseParallel(3),
                f"h.{i}.attn.c_proj": RowwiseParallel(),
                f"h.{i}.mlp.c_fc": ColwiseParallel(),
                f"h.{i}.mlp.c_proj": RowwiseParallel(),
            }
        )
    if module.lm_head is not None:
        plan["ln_f"] = ReplicateParallel()
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan
