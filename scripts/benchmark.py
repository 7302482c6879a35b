"""Throughput of titanlike's training path against a plain PyTorch loop, same model, same data, one device.

    python scripts/benchmark.py --flavor 1B --batch 4 --seq-len 2048 --steps 20 --compile        # on a GPU
    python scripts/benchmark.py --flavor tiny --batch 2 --seq-len 64 --steps 3 --warmup 1         # CPU smoke

Two rows, each timed over ``--steps`` steps after ``--warmup`` untimed ones (compilation happens there):

* ``titanlike``: the best titanlike does on one device with its own features: the model through
  ``build_parallel_model`` (the trainer's builder) on a 1-rank mesh (gloo on CPU, nccl on CUDA), which on one
  rank applies float8
  (``--float8 tensorwise|rowwise|rowwise_with_gw_hp``, torchao; ``--float8-backend te`` with ``--kernels te``
  for Transformer Engine), activation checkpointing (``--ac``: selective AC is what lets the batch grow) and
  per-block compile, and no FSDP wrapper (``--fsdp auto``, the default: bf16 by autocast, the single-device
  trainer path). ``--fsdp on`` adds the FSDP2 wrapper on the 1-rank mesh with bf16 parameters and float32
  reductions, i.e. the per-device path of a data-parallel run. Each step is
  ``titanlike.training.step.train_step``: the global-token loss (``cross_entropy_loss``, chunked with
  ``--loss-chunk``), gradient clipping, AdamW (fused on CUDA), one host sync per step (loss and grad norm in
  one copy, for the non-finite check).
* ``plain``: the honest plain loop: the same model and initial weights, per-block ``Module.compile()``, bf16
  autocast, fused AdamW on CUDA (foreach on CPU), ``F.cross_entropy`` in float32, ``clip_grad_norm_``; no AC,
  no FSDP, no float8, no host sync inside the timed steps.

``--only titanlike`` / ``--only plain`` runs one row (``scripts/gpu_check.sh`` times plain once per batch size).

Reported: tokens/s, MFU (``titanlike.training.mfu``; needs a known GPU or ``--peak-tflops``), peak memory
(CUDA: ``max_memory_allocated``; CPU: the process's peak RSS during the run) and the ratio titanlike/plain.
Timings on a shared CPU are noise; the CPU run is a smoke test. Data are random token ids (no data loader).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from titanlike.config import JobConfig  # noqa: E402
from titanlike.layout import FLOAT8_RECIPES, float8_violations  # noqa: E402
from titanlike.models import get_spec, registered  # noqa: E402
from titanlike.training.mfu import device_peak_flops, mfu, peak_key  # noqa: E402

GiB = 2**30


@dataclass
class Row:
    name: str
    tokens_per_s: float
    mfu: float | None
    peak_mem_gib: float
    loss: float
    seconds: float


# ---------------------------------------------------------------------------------------------- helpers
def _device(arg: str) -> torch.device:
    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(arg)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):  # Linux: "5" resets the peak RSS (VmHWM) of this process
            Path("/proc/self/clear_refs").write_text("5")


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GiB
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GiB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_one_rank_group(device: torch.device) -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def model_args(flavor: str, seq_len: int, vocab: int, model: str = "llama3"):
    flavors = get_spec(model).flavors
    if flavor not in flavors:
        raise SystemExit(f"error: --flavor {flavor} is not a flavor of {model}; valid: {', '.join(flavors)}")
    args = flavors[flavor]
    if vocab > 0 or args.vocab_size <= 0:
        args = args.replace(vocab_size=vocab if vocab > 0 else 2048)
    return args.replace(max_seq_len=max(args.max_seq_len, seq_len))


def build_model(args, device: torch.device, seed: int, model_name: str = "llama3") -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        model = get_spec(model_name).build(args)
        model.init_weights()
    return model


def make_batches(n: int, batch: int, seq_len: int, vocab: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, batch, seq_len + 1), generator=g)
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]


def job_config(a: argparse.Namespace) -> JobConfig:
    cfg = JobConfig()
    cfg.training.dtype = a.dtype
    cfg.training.max_norm = 1.0
    cfg.model.kernels = a.kernels
    cfg.model.name = a.model
    cfg.float8.recipe = a.float8
    if a.float8:
        cfg.float8.backend = a.float8_backend
        cfg.float8.emulate = a.float8_emulate
    cfg.compile.enable = a.compile
    if a.ac == "none":
        cfg.activation_checkpoint.mode = "none"
    elif a.ac == "full":
        cfg.activation_checkpoint.mode = "full"
    else:
        cfg.activation_checkpoint.mode = "selective"
        cfg.activation_checkpoint.selective_ac_option = a.ac
    cfg.parallelism.loss_chunk_size = a.loss_chunk
    cfg.metrics.peak_tflops = a.peak_tflops
    return cfg


def _timed(step_fn, batches, warmup: int, steps: int, device: torch.device) -> tuple[float, float]:
    """(seconds for ``steps`` timed steps, last loss); ``warmup`` untimed steps first."""
    loss = float("nan")
    for i in range(warmup):
        loss = step_fn(batches[i % len(batches)])
    _sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step_fn(batches[(warmup + i) % len(batches)])
    _sync(device)
    return time.perf_counter() - t0, float(loss)


# ---------------------------------------------------------------------------------------------- the two paths
def run_titanlike(a, args, batches, device: torch.device) -> tuple[float, float, float]:
    from titanlike.kernels import convert_kernels
    from titanlike.parallel import ParallelDims, apply_fsdp, build_parallel_model
    from titanlike.training.optim import build_optimizer
    from titanlike.training.step import train_step

    cfg = job_config(a)
    _init_one_rank_group(device)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    dims.build_mesh(device.type)
    model = build_model(args, device, a.seed, a.model)
    convert_kernels(model, a.kernels, a.float8 if a.float8_backend == "te" else "")
    built = build_parallel_model(model, cfg, dims, device)  # the trainer's builder (torchao float8 here)
    model, forward_ctx = built.model_parts[0], built.forward_context
    if a.fsdp == "on":  # FSDP2 on this one rank as well (its wrapper cost; see docs/facts.md)
        bf16 = a.dtype == "bfloat16"
        apply_fsdp(
            model,
            dims.fsdp_mesh(),
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
        forward_ctx = contextlib.nullcontext  # FSDP's mixed precision computes in bf16
    optimizer = build_optimizer([model], cfg)

    def step(batch):
        return train_step(
            [model],
            optimizer,
            [batch],
            built.loss,
            max_norm=cfg.training.max_norm,
            clip_fn=built.clip_fn,
            forward_ctx=forward_ctx,
        ).loss

    _reset_peak(device)
    seconds, last = _timed(step, batches, a.warmup, a.steps, device)
    return seconds, last, _peak_gib(device)


def run_plain(a, args, batches, device: torch.device) -> tuple[float, float, float]:
    model = build_model(args, device, a.seed, a.model)
    if a.compile:
        for block in model.layers.values():
            block.compile()
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=8e-4,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        fused=cuda or None,
        foreach=None if cuda else True,
    )
    bf16 = a.dtype == "bfloat16"

    def step(batch):
        inputs, labels = batch
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(inputs)
        logits, *depths = out if isinstance(out, tuple) else (out,)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        for k, d in enumerate(depths, 1):  # MTP depths (deepseek_v3): the labels k further, weight 0.3 / D
            mtp = F.cross_entropy(d[:, :-k].flatten(0, 1).float(), labels[:, k:].flatten())
            loss = loss + 0.3 / len(depths) * mtp
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.detach()

    _reset_peak(device)
    seconds, last = _timed(step, batches, a.warmup, a.steps, device)
    return seconds, last, _peak_gib(device)


# ---------------------------------------------------------------------------------------------- main
def _float8_label(a: argparse.Namespace) -> str:
    if not a.float8:
        return "off"
    return f"{a.float8} ({a.float8_backend}{', emulated' if a.float8_emulate else ''})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3", choices=registered(), help="model.name")
    ap.add_argument("--flavor", default="debugmodel", help="a flavor of --model")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (compilation)")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the flavor's, or 2048)")
    ap.add_argument("--ac", default="none", help="none | full | op | N (every N-th block)")
    ap.add_argument("--kernels", default="torch", choices=("torch", "te"))
    ap.add_argument(
        "--float8",
        default="",
        choices=("",) + FLOAT8_RECIPES,
        help="float8 recipe of the titanlike row (torchao: tensorwise | rowwise | rowwise_with_gw_hp)",
    )
    ap.add_argument(
        "--float8-backend",
        default="torchao",
        choices=("torchao", "te"),
        help="torchao (Float8Linear, the default) or te (needs --kernels te)",
    )
    ap.add_argument("--float8-emulate", action="store_true", help="torchao's emulation (CPU, tests)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument(
        "--fsdp",
        default="auto",
        choices=("on", "auto"),
        help="auto: as parallelize_model decides (no FSDP on one rank: the single-GPU path); "
        "on: FSDP2 wrapper on the 1-rank mesh (the per-device path of a data-parallel run)",
    )
    ap.add_argument("--loss-chunk", type=int, default=0, help="titanlike loss chunk size (0: unchunked)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="override the device peak for MFU")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--only", default="both", choices=("both", "titanlike", "plain"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="also write the results to this file")
    a = ap.parse_args(argv)
    if a.ac not in ("none", "full", "op") and not a.ac.isdigit():
        ap.error(f"--ac must be none, full, op or a positive integer, got {a.ac!r}")
    if a.float8:
        cfg = job_config(a)
        cfg.model.flavor = a.flavor
        problems = float8_violations(cfg)
        if problems:
            ap.error(problems[0].replace("float8.recipe=", "--float8 ").replace("float8.backend", "--float8-backend"))
    elif a.float8_emulate:
        ap.error("--float8-emulate needs --float8 <recipe>")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    device = _device(a.device)
    if a.float8 and a.float8_backend == "torchao" and a.only != "plain":
        from titanlike.kernels.float8 import Float8UnavailableError, check_float8_runtime

        try:
            check_float8_runtime(a.float8, a.float8_emulate, device)
        except Float8UnavailableError as e:
            print(f"benchmark: {e}", file=sys.stderr)
            return 2
    if a.kernels == "te":
        from titanlike.kernels import TEUnavailableError, load_te

        try:
            load_te()
        except TEUnavailableError as e:
            print(f"benchmark: {e}", file=sys.stderr)
            return 2
    args = model_args(a.flavor, a.seq_len, a.vocab, a.model)
    batches = make_batches(min(a.steps + a.warmup, 8), a.batch, a.seq_len, args.vocab_size, device, a.seed)
    tokens = a.batch * a.seq_len * a.steps
    fpt = get_spec(a.model).flops_per_token(args, a.seq_len)
    peak = device_peak_flops(device, peak_key(a.dtype, a.float8), a.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"benchmark: flavor={a.flavor} ({args.num_params() / 1e6:.1f}M params, vocab {args.vocab_size}) "
        f"batch={a.batch} seq={a.seq_len} steps={a.steps} (+{a.warmup} warmup) dtype={a.dtype} "
        f"compile={a.compile} ac={a.ac} kernels={a.kernels} "
        f"float8={_float8_label(a)} "
        f"fsdp={a.fsdp} loss_chunk={a.loss_chunk or 'off'} "
        f"device={name}; peak {'n/a' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}",
        flush=True,
    )
    runners = {"titanlike": run_titanlike, "plain": run_plain}
    rows: list[Row] = []
    try:
        for key, fn in runners.items():
            if a.only not in ("both", key):
                continue
            seconds, loss, mem = fn(a, args, batches, device)
            tps = tokens / seconds
            rows.append(Row(key, tps, mfu(tps, fpt, peak), mem, loss, seconds))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    mem_kind = "alloc" if device.type == "cuda" else "RSS"
    print(f"{'path':<10} {'tokens/s':>12} {'MFU':>7} {'peak ' + mem_kind + ' GiB':>15} {'loss':>9} {'s':>8}")
    for r in rows:
        m = "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%"
        print(f"{r.name:<10} {r.tokens_per_s:12,.0f} {m:>7} {r.peak_mem_gib:15.2f} {r.loss:9.4f} {r.seconds:8.2f}")
    ratio = rows[0].tokens_per_s / rows[1].tokens_per_s if len(rows) == 2 else None
    if ratio is not None:
        print(f"ratio titanlike/plain: {ratio:.3f}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"args": vars(a), "device": name, "rows": [r.__dict__ for r in rows], "ratio": ratio}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
