"""Activation checkpointing on 2 ranks, float64: under tensor parallelism (tp=2, with and without SP) and
under FSDP2 (dp=2), every AC mode gives the single-device gradients without AC; under TP, op-level AC
recomputes no collective in the backward while full AC does.

Run by ``test_activation_checkpoint.py``: ``python tests/parallel/ac_parallel_worker.py`` prints one JSON line.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from dist_utils import spawn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from titanlike.config import ActivationCheckpoint  # noqa: E402
from titanlike.models.llama import FLAVORS, Transformer  # noqa: E402
from titanlike.parallel.activation_checkpoint import apply_ac  # noqa: E402
from titanlike.parallel.fsdp import apply_fsdp  # noqa: E402
from titanlike.parallel.tensor_parallel import apply_tp  # noqa: E402

CONFIGS = {
    "none": ActivationCheckpoint(mode="none"),
    "full": ActivationCheckpoint(mode="full"),
    "every2": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
    "op": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
}


class CollectiveCounter(TorchDispatchMode):
    """Counts functional collectives (what DTensor redistributions issue); not waits nor autograd wrappers."""

    COLLECTIVES = {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] in self.COLLECTIVES:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def worker(rank: int, world_size: int, out: str | None = None) -> None:
    """Every case; rank 0 prints the JSON line, or writes it to ``out`` (tests/parallel/shared_launch.py)."""
    torch.manual_seed(0)
    args = FLAVORS["tiny"].replace(vocab_size=64, dim=64, n_layers=2, max_seq_len=32)
    base = Transformer(args).to(torch.float64)
    base.init_weights()
    tokens = torch.randint(0, 64, (2, 17))
    ref = copy.deepcopy(base)
    _loss(ref, tokens).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    mesh = init_device_mesh("cpu", (world_size,))
    result = {}
    for sp in (False, True):
        for name, cfg in CONFIGS.items():
            model = copy.deepcopy(base)
            apply_tp(model, mesh, sequence_parallel=sp, loss_parallel=False)
            names = [n for n, _ in model.named_parameters()]
            apply_ac(model, cfg)
            same_names = names == [n for n, _ in model.named_parameters()] == list(ref_grads)
            loss = _loss(model, tokens)
            with CollectiveCounter() as comm:
                loss.backward()
            diff = max(
                (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).sub(ref_grads[n]).abs().max().item()
                for n, p in model.named_parameters()
            )
            backward_collectives = comm.count
            result[f"{'sp' if sp else 'tp'}/{name}"] = {
                "max_grad_diff": diff,
                "same_names": same_names,
                "backward_collectives": backward_collectives,
            }
    # FSDP dp=2: each rank takes half the batch; the loss is its CE sum over the global token count and
    # the FSDP wrapper sums gradients, so they equal the one-device mean-loss gradients.
    n_tokens = tokens[:, 1:].numel()
    for name, cfg in CONFIGS.items():
        model = copy.deepcopy(base)
        names = [n for n, _ in model.named_parameters()]
        apply_ac(model, cfg)
        apply_fsdp(model, mesh)
        same_names = names == [n for n, _ in model.named_parameters()]
        local = tokens[rank::world_size]
        logits = model(local[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), local[:, 1:].flatten(), reduction="sum") / n_tokens
        loss.backward()
        diff = max(p.grad.full_tensor().sub(ref_grads[n]).abs().max().item() for n, p in model.named_parameters())
        result[f"fsdp/{name}"] = {"max_grad_diff": diff, "same_names": same_names}
    # Identical on every rank or not: reduce the worst diff so every rank agrees on pass/fail.
    worst = torch.tensor(max(r["max_grad_diff"] for r in result.values()), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        line = json.dumps({"results": result, "worst": worst.item()})
        if out is None:
            print(line, flush=True)
        else:
            Path(out).write_text(line)


if __name__ == "__main__":
    sys.exit(spawn(worker, 2, timeout_s=60))
