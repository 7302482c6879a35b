"""Multi-process checks for titanlike.parallel.loss_parallel, run by tests/parallel/test_loss_parallel.py.

    python tests/parallel/loss_parallel_worker.py WORLD_SIZE OUT_DIR

Forks WORLD_SIZE gloo ranks that run every case in float64 against F.cross_entropy on the full logits and
against torch's ``loss_parallel()``. Each measured error is MAX-reduced over the ranks, so a wrong value
on any rank shows, and rank 0 writes ``OUT_DIR/results.json`` {case: {metric: value}}; pytest asserts on
it. A rank that raises writes ``OUT_DIR/error_rank{r}.txt`` and exits at once (start_processes then stops the
others), so a failure never waits for a collective.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

import titanlike.parallel.loss_parallel as lp

SHAPE = (3, 5)  # 15 tokens
CHUNK = 4  # 4 chunks, the last one partial


def _inputs(vocab: int, ignore_index: int, all_ignored: bool = False, dtype=torch.float64):
    """Same logits and labels on every rank; labels hit both ends of the vocab and every shard."""
    g = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(*SHAPE, vocab, generator=g, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, vocab, SHAPE, generator=g)
    flat = labels.view(-1)
    flat[:4] = torch.tensor([0, vocab - 1, vocab // 2, (vocab - 1) // 3])
    flat[[5, 11]] = ignore_index
    if all_ignored:
        labels.fill_(ignore_index)
    return logits, labels


def _reference(logits, labels, ignore_index, reduction):
    """F.cross_entropy on the full float64 logits (the mean of zero tokens defined as 0) and its gradient."""
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x.view(-1, x.shape[-1]), labels.view(-1), ignore_index=ignore_index, reduction="sum")
    if reduction == "mean":
        loss = loss / (labels != ignore_index).sum().clamp(min=1)
    loss.backward()
    return loss.detach(), x.grad


def _torch_loss_parallel(logits, labels, mesh, ignore_index, reduction):
    """PyTorch's own vocab-parallel loss on a (tokens, vocab) DTensor sharded over the 1-D mesh."""
    x = distribute_tensor(logits.view(-1, logits.shape[-1]), mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(x, labels.view(-1), ignore_index=ignore_index, reduction=reduction)
        loss.backward()
    return loss.full_tensor().detach(), x.grad.full_tensor().view_as(logits)


def _ours(logits, labels, mesh, placements, **kw):
    """Our loss on a DTensor, backward from 1.7 * loss; returns (loss, full gradient gathered for the test,
    all-reduce log)."""
    leaf = distribute_tensor(logits, mesh, placements).requires_grad_()
    # Logits come out of an op (the head), never a leaf: torch 2.11 accumulates the gradient that to_local()'s backward
    # hands a leaf DTensor with an uneven shard as Replicate (an all-gather more; 2.13 keeps the shard)
    x = leaf * 1.0
    calls = {"forward": [], "backward": []}
    phase = "forward"
    real = lp._all_reduce

    def counting(t, op, group):
        calls[phase].append(op)
        return real(t, op, group)

    lp._all_reduce = counting
    try:
        with CommDebugMode() as fwd_comm:
            loss = lp.loss_parallel_cross_entropy(x, labels, **kw)
        phase = "backward"
        with CommDebugMode() as bwd_comm:
            (1.7 * loss).backward()
    finally:
        lp._all_reduce = real
    assert type(loss) is torch.Tensor and leaf.grad.placements == leaf.placements, leaf.grad.placements
    log = {
        "forward": calls["forward"],
        "backward": calls["backward"],
        "forward_comm": fwd_comm.get_total_counts(),
        "backward_comm": bwd_comm.get_total_counts(),
    }
    return loss.detach(), leaf.grad.full_tensor(), log


def _spread(value: torch.Tensor) -> float:
    """max - min of a scalar over all ranks (0 when every rank holds the same loss)."""
    hi, lo = value.clone(), value.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return (hi - lo).item()


def _err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _case(
    mesh,
    placements,
    vocab,
    ignore_index,
    reduction,
    chunk_size,
    *,
    all_ignored=False,
    dtype=torch.float64,
    torch_mesh=None,
):
    logits, labels = _inputs(vocab, ignore_index, all_ignored, dtype)
    kw = dict(ignore_index=ignore_index, reduction=reduction, chunk_size=chunk_size)
    ref_loss, ref_grad = _reference(logits, labels, ignore_index, reduction)
    ref_grad = 1.7 * ref_grad  # the upstream gradient _ours uses
    loss, grad, log = _ours(logits, labels, mesh, placements, **kw)
    n_chunks = 1 if chunk_size is None else -(-labels.numel() // chunk_size)
    res = {
        "loss_err": _err(loss, ref_loss),
        "grad_err": _err(grad, ref_grad),
        "ref_grad_max": ref_grad.abs().max().item(),
        "rank_spread": _spread(loss),
        "loss_is_finite": float(torch.isfinite(loss).item()),
        # Expected: MAX, SUM, SUM per chunk in the forward, nothing in the backward.
        "fwd_order_ok": float(log["forward"] == [dist.ReduceOp.MAX, dist.ReduceOp.SUM, dist.ReduceOp.SUM] * n_chunks),
        "fwd_all_reduces": len(log["forward"]),
        "fwd_comm": log["forward_comm"],
        "bwd_all_reduces": len(log["backward"]),
        "bwd_comm": log["backward_comm"],
        "expected_fwd": 3 * n_chunks,
        "dtype_ok": float(loss.dtype == torch.promote_types(dtype, torch.float32) and grad.dtype == dtype),
    }
    if torch_mesh is not None and not all_ignored:
        t_loss, t_grad = _torch_loss_parallel(logits, labels, torch_mesh, ignore_index, reduction)
        res["torch_loss_err"] = _err(loss, t_loss)
        res["torch_grad_err"] = _err(grad, 1.7 * t_grad)
    return res


def _explicit_split_case(world_size):
    """The plain-tensor API with a hand-made, very uneven split (rank r owns r+1 columns more than rank 0)."""
    sizes = [1 + 2 * r for r in range(world_size)]
    vocab = sum(sizes)
    logits, labels = _inputs(vocab, -100)
    rank = dist.get_rank()
    start = sum(sizes[:rank])
    local = logits[..., start : start + sizes[rank]].clone().requires_grad_()
    loss = lp.vocab_parallel_cross_entropy(
        local, labels, vocab_start=start, group=None, reduction="mean", chunk_size=CHUNK
    )
    loss.backward()
    full_grad = torch.zeros_like(logits)  # gathered for the test: each rank fills its columns, then SUM
    full_grad[..., start : start + sizes[rank]] = local.grad
    dist.all_reduce(full_grad)
    ref_loss, ref_grad = _reference(logits, labels, -100, "mean")
    return {
        "loss_err": _err(loss, ref_loss),
        "grad_err": _err(full_grad, ref_grad),
        "rank_spread": _spread(loss.detach()),
    }


def _mutation_case(mesh, skip_position, chunk_size):
    """Error vs F.cross_entropy when the all-reduce at ``skip_position`` of each chunk (0 MAX, 1 sum-exp,
    2 target logit) is replaced by a no-op on every rank."""
    real = lp._all_reduce
    count = [0]

    def mutated(t, op, group):
        position = count[0] % 3
        count[0] += 1
        return t if position == skip_position else real(t, op, group)

    logits, labels = _inputs(11, -100)
    ref_loss, ref_grad = _reference(logits, labels, -100, "sum")
    x = distribute_tensor(logits, mesh, [Shard(2)]).requires_grad_()
    lp._all_reduce = mutated
    try:
        loss = lp.loss_parallel_cross_entropy(x, labels, chunk_size=chunk_size)
        loss.backward()
    finally:
        lp._all_reduce = real
    return {"loss_err": _err(loss.detach(), ref_loss), "grad_err": _err(x.grad.full_tensor(), ref_grad)}


def _checks(world_size):
    tp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    results = {}
    # Vocab sizes: even, uneven (torch.chunk layout), and (for 4 ranks) one with an empty last shard.
    vocabs = [12, 11] if world_size == 2 else [11, 5]
    for vocab in vocabs:
        for ignore_index in (-100, 2):
            for reduction in ("sum", "mean"):
                for chunk_size in (None, CHUNK):
                    name = f"tp{world_size}_V{vocab}_ign{ignore_index}_{reduction}_chunk{chunk_size}"
                    # torch's own loss_parallel fails on an empty shard (index out of bounds in its gather).
                    empty_shard = (world_size - 1) * -(-vocab // world_size) >= vocab
                    torch_mesh = None if empty_shard else tp
                    results[name] = _case(
                        tp, [Shard(-1)], vocab, ignore_index, reduction, chunk_size, torch_mesh=torch_mesh
                    )
    for chunk_size in (None, CHUNK):
        results[f"all_ignored_mean_chunk{chunk_size}"] = _case(
            tp, [Shard(2)], 11, -100, "mean", chunk_size, all_ignored=True
        )
    results["bf16"] = _case(tp, [Shard(2)], 11, -100, "mean", CHUNK, dtype=torch.bfloat16)
    if world_size == 4:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        results["mesh2d_vocab_on_tp"] = _case(mesh2d, [Replicate(), Shard(2)], 11, -100, "mean", CHUNK)
        results["mesh2d_vocab_on_dp"] = _case(mesh2d, [Shard(-1), Replicate()], 11, -100, "sum", None)
    results["explicit_split"] = _explicit_split_case(world_size)
    for position, what in enumerate(("max", "sum_exp", "target")):
        for chunk_size in (None, CHUNK):
            results[f"mutation_drop_{what}_chunk{chunk_size}"] = _mutation_case(tp, position, chunk_size)
    return results


def rank_main(rank: int, world_size: int, out: str) -> None:
    """Every case on the current process group; rank 0 writes ``out`` (also run by tests/parallel/shared_launch.py)."""
    results = _checks(world_size)
    # Worst value over the ranks for every metric, in one collective.
    keys = [(case, metric) for case, metrics in results.items() for metric in metrics]
    worst = torch.tensor([float(results[c][m]) for c, m in keys], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        merged = {}
        for (case, metric), value in zip(keys, worst.tolist()):
            merged.setdefault(case, {})[metric] = value
        with open(f"{out}.tmp", "w") as f:
            json.dump(merged, f, indent=1)
        os.replace(f"{out}.tmp", out)


def _run(rank: int, world_size: int, out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out_dir}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=30),
        )
        rank_main(rank, world_size, os.path.join(out_dir, "results.json"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error_rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    # A clean interpreter exit after gloo sometimes aborts (see shared notes); skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    world_size, out_dir = int(sys.argv[1]), sys.argv[2]
    # fork: the ranks inherit the imported torch instead of importing it again each (seconds per rank here).
    torch.multiprocessing.start_processes(
        _run, args=(world_size, out_dir), nprocs=world_size, join=True, start_method="fork"
    )
