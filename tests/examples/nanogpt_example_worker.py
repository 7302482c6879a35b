"""Runs examples/nanogpt_parallel.py's ``main`` on 8 forked gloo ranks (pp 2 x dp 2 x tp 2) and compares it with the
same model trained on one process, in float64: every step's loss and gradient norm; after the last step before the
checkpoint, every gradient and weight (``full_tensor()``); after the resumed step, the same again; the checkpoint
read back in one process; the fused ``c_attn`` weights in their q|k|v order right after parallelizing; and one
planted mutation (a plain ``ColwiseParallel`` on ``c_attn``) that must break the loss.

    python tests/examples/nanogpt_example_worker.py --out result.json --checkpoint DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nanogpt_parallel as ex  # examples/ is on the path (dist_utils.worker_env)
import torch
import torch.distributed as dist
import torch.nn.functional as F

STEPS = 3


def reference(config) -> list[dict]:
    """One process: the same seed, batches, loss (mean CE over the global batch), clipping and AdamW."""
    torch.manual_seed(0)
    model = ex.GPT(config).to(torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ex.LR)
    records = []
    for step in range(STEPS + 1):
        optimizer.zero_grad(set_to_none=True)
        inputs, labels = ex.batch(step, config)
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ex.MAX_NORM)
        grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        optimizer.step()
        weights = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        records.append({"loss": loss.item(), "norm": norm.item(), "grads": grads, "weights": weights})
    return records


def _full(t):
    """The whole tensor; the chunk-sharded c_attn through titanlike's gather (torch 2.11's ``full_tensor()`` refuses
    its ``_StridedShard``; tests/parallel/test_parallel_probes.py checks torch's own on 2.13 and later)."""
    from titanlike.parallel.fused import gather_strided, is_strided

    if not hasattr(t, "full_tensor"):
        return t
    return (gather_strided(t) if is_strided(t) else t).full_tensor()


def compare(parts, grads: dict, weights: dict) -> tuple[float, float, list[str]]:
    """Max |diff| of every gradient and weight of this rank's stages, and the names it compared."""
    g = w = 0.0
    names = []
    for part in parts:
        for name, p in part.named_parameters():
            names.append(name)
            w = max(w, (_full(p.detach()) - weights[name]).abs().max().item())
            g = max(g, (_full(p.grad) - grads[name]).abs().max().item() if p.grad is not None else float("inf"))
    return g, w, names


def rank_main(rank: int, world_size: int, out: str, checkpoint: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel

    from titanlike.checkpoint import read_model_state_dict

    config = ex.GPTConfig()
    ref = reference(config)
    r = {}
    # The fused c_attn (and every other weight) comes out whole in the single-device order at build.
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    fresh, _ = ex.build(config, mesh, seed=0)
    torch.manual_seed(0)
    initial = dict(ex.GPT(config).to(torch.float64).named_parameters(remove_duplicate=False))
    r["initial_weights"] = max(
        (_full(p.detach()) - initial[n]).abs().max().item()
        for part in fresh.model_parts
        for n, p in part.named_parameters()
    )
    c_attn = [p for part in fresh.model_parts for n, p in part.named_parameters() if n.endswith("attn.c_attn.weight")]
    r["c_attn_is_chunk_sharded"] = all(p.to_local().shape[0] == p.shape[0] // 2 for p in c_attn) and bool(c_attn)

    # The example itself.
    done = ex.main(["--steps", str(STEPS), "--checkpoint", checkpoint])
    results = done["results"]
    r["loss"] = max(abs(res.loss - rec["loss"]) for res, rec in zip(results, ref))
    r["grad_norm"] = max(abs(res.grad_norm - rec["norm"]) for res, rec in zip(results, ref))
    r["clipped"] = min(rec["norm"] for rec in ref) > 2 * ex.MAX_NORM
    r["grads"], r["weights"], names = compare(
        done["pp"].model_parts, ref[STEPS - 1]["grads"], ref[STEPS - 1]["weights"]
    )
    r["resumed_grads"], r["resumed_weights"], _ = compare(
        done["resumed"].model_parts, ref[STEPS]["grads"], ref[STEPS]["weights"]
    )
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, names)
    r["coverage"] = sorted(set(ref[0]["weights"]) - {n for ns in everyone for n in ns})
    r["checkpoint"], r["checkpoint_keys_missing"] = 0.0, []
    if rank == 0:  # the checkpoint in one process: the single-device tensors (c_attn in q|k|v order)
        saved = read_model_state_dict(checkpoint)
        r["checkpoint_keys_missing"] = sorted(set(ref[0]["weights"]) - set(saved))
        r["checkpoint"] = max((saved[n] - ref[STEPS - 1]["weights"][n]).abs().max().item() for n in saved)

    # Planted mutation: a plain ColwiseParallel on c_attn gives rank 0 all of q and half of k: wrong from step 1.
    real = ex.FusedColwiseParallel
    ex.FusedColwiseParallel = lambda n: ColwiseParallel()
    try:
        mutated, optimizer = ex.build(config, mesh, seed=0)
        r["mutation_plain_colwise_loss"] = abs(ex.train(mutated, optimizer, mesh, 0, config).loss - ref[0]["loss"])
    finally:
        ex.FusedColwiseParallel = real

    numbers = torch.tensor([v for k, v in sorted(r.items()) if isinstance(v, float)], dtype=torch.float64)
    numbers = torch.nan_to_num(numbers, nan=float("inf"))
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
    for k, v in zip([k for k, v in sorted(r.items()) if isinstance(v, float)], numbers.tolist()):
        r[k] = v
    flags = torch.tensor([float(r["clipped"]), float(r["c_attn_is_chunk_sharded"])])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    r["clipped"], r["c_attn_is_chunk_sharded"] = bool(flags[0]), bool(flags[1])
    if rank == 0:
        Path(out).write_text(json.dumps(r, indent=1))


def main() -> int:
    from dist_utils import spawn

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()
    return spawn(rank_main, 8, a.out, a.checkpoint, timeout_s=a.timeout)


if __name__ == "__main__":
    sys.exit(main())
