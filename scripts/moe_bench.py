"""The MoE layer's expert computation, grouped matmul against a per-expert loop, timed side by side in one run.

    python scripts/moe_bench.py                                   # CPU, float32, sized for a 2-core machine
    python scripts/moe_bench.py --device cuda                     # GPU, bfloat16, a Qwen3-30B-A3B MoE layer
    python scripts/moe_bench.py --tokens 64 --dim 16 --hidden 32 --experts 4 --steps 1 --warmup 0   # smoke

Both rows run the same ``titanlike.models.moe.MoE`` block (same weights, same tokens, same routing), one
forward + backward per step, differing only in ``experts_impl``:

* ``grouped``: ``torch._grouped_mm`` over the expert-sorted rows, each expert's group zero-padded to 16 bytes of
  rows (on CUDA in bf16 with compute capability 9.x / 10.x torch's CUTLASS kernel; elsewhere torch's fallback,
  a loop of ``mm`` inside the op);
* ``loop``: one matmul per expert on its rows (the exact path, the only one in float64).

The rows alternate step by step (``--steps`` timed of each after ``--warmup`` untimed), so drifting load on a
shared machine hits both alike. Printed: each row's tokens/s and ms per step, the ratio grouped/loop, the rows'
output difference (they compute the same thing), and the padding the grouped path added. ``--json PATH`` writes
the same as JSON. Timings on a shared CPU are noise; a GPU number comes from a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from titanlike.models.moe import MoE, MoEArgs, grouped_alignment  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (tokens, dim, hidden, experts, top_k): CPU sized for ~1 s a step on 2 cores; CUDA: Qwen3-30B-A3B's MoE layer
DEFAULTS = {"cpu": (2048, 256, 512, 16, 2, "float32"), "cuda": (16384, 2048, 768, 128, 8, "bfloat16")}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (batch x sequence)")
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None, help="hidden size of one routed expert")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: stable on a shared machine)")
    ap.add_argument(
        "--float8",
        action="store_true",
        help="add a row with torchao's float8 grouped GEMM (CUDA compute capability 9.0+, Triton)",
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    tokens, dim, hidden, experts, top_k, dtype = DEFAULTS[a.device]
    a.tokens, a.dim, a.hidden = a.tokens or tokens, a.dim or dim, a.hidden or hidden
    a.experts, a.top_k, a.dtype = a.experts or experts, a.top_k or top_k, a.dtype or dtype
    align = grouped_alignment(DTYPES[a.dtype])
    problems = [f"--{n} must be >= 1" for n in ("tokens", "dim", "hidden", "experts", "top_k") if getattr(a, n) < 1]
    problems += [f"--{n} {getattr(a, n)} is not a multiple of {align} ({a.dtype})" for n in ("dim", "hidden")
                 if getattr(a, n) % align]  # fmt: skip
    if a.top_k > a.experts:
        problems.append(f"--top-k {a.top_k} exceeds --experts {a.experts}")
    if a.steps < 1 or a.warmup < 0 or a.threads < 1:
        problems.append("--steps and --threads must be >= 1, --warmup >= 0")
    if a.float8:
        from titanlike.kernels.float8 import experts_float8_unavailable

        why = experts_float8_unavailable(emulate=a.device != "cuda")
        if why:
            problems.append(f"--float8: {why} (on {a.device})")
        elif a.dtype != "bfloat16" or a.dim % 16 or a.hidden % 16:
            problems.append("--float8 needs --dtype bfloat16 and --dim, --hidden multiples of 16")
    if problems:
        ap.error("; ".join(problems))
    return a


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> dict:
    a = parse(argv)
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    args = MoEArgs(dim=a.dim, hidden_dim=a.hidden, num_experts=a.experts, top_k=a.top_k)
    blocks = {}
    for impl in ("grouped", "loop"):
        blocks[impl] = MoE(args.replace(experts_impl=impl)).to(device)
    with torch.no_grad():  # on the device (the layout-independent init would draw ~600M values on the host)
        for p in blocks["grouped"].parameters():
            torch.nn.init.trunc_normal_(p, std=0.02)
    blocks["loop"].load_state_dict(blocks["grouped"].state_dict())
    if a.float8:  # the same weights through torchao's float8 grouped GEMM
        from titanlike.kernels.float8 import convert_experts_to_float8

        blocks["grouped_fp8"] = MoE(args.replace(experts_impl="grouped")).to(device)
        blocks["grouped_fp8"].load_state_dict(blocks["grouped"].state_dict())
        convert_experts_to_float8(blocks["grouped_fp8"])
    for b in blocks.values():
        b.to(dtype)
    x = torch.randn(1, a.tokens, a.dim, generator=torch.Generator().manual_seed(a.seed)).to(device, dtype)
    outs, times = {}, {impl: 0.0 for impl in blocks}

    def step(impl: str) -> float:
        b = blocks[impl]
        b.zero_grad(set_to_none=True)
        _sync(device)
        t0 = time.perf_counter()
        out = b(x.detach().requires_grad_())
        out.float().square().mean().backward()
        _sync(device)
        outs[impl] = out.detach()
        return time.perf_counter() - t0

    for _ in range(a.warmup):
        for impl in blocks:
            step(impl)
    for _ in range(a.steps):
        for impl in blocks:
            times[impl] += step(impl)
    routed, align = a.tokens * a.top_k, grouped_alignment(dtype)
    padded = -(-(routed + a.experts * (align - 1)) // align) * align  # pad_groups' static buffer
    rows = {impl: {"tokens_per_s": a.steps * a.tokens / t, "ms_per_step": 1000 * t / a.steps} for impl, t in
            times.items()}  # fmt: skip
    result = {
        "args": {k: v for k, v in vars(a).items() if k != "json"},
        "rows": rows,
        "ratio_grouped_over_loop": rows["grouped"]["tokens_per_s"] / rows["loop"]["tokens_per_s"],
        "max_output_diff": (outs["grouped"].float() - outs["loop"].float()).abs().max().item(),
        "routed_rows": routed,
        "padded_rows": padded,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if a.float8:
        result["ratio_fp8_over_grouped"] = rows["grouped_fp8"]["tokens_per_s"] / rows["grouped"]["tokens_per_s"]
        result["max_fp8_output_diff"] = (outs["grouped_fp8"].float() - outs["loop"].float()).abs().max().item()
    print(
        f"MoE layer: {a.tokens} tokens x dim {a.dim}, {a.experts} experts of hidden {a.hidden}, top-{a.top_k}, "
        f"{a.dtype} on {result['device_name']}; forward + backward, {a.steps} steps each after {a.warmup} warmup"
    )
    for impl, r in rows.items():
        print(f"{impl:<11} {r['tokens_per_s']:>12,.0f} tokens/s {r['ms_per_step']:>10.2f} ms/step")
    print(f"ratio grouped/loop: {result['ratio_grouped_over_loop']:.3f}")
    if a.float8:
        print(
            f"ratio grouped_fp8/grouped: {result['ratio_fp8_over_grouped']:.3f}; max |grouped_fp8 - loop| output: "
            f"{result['max_fp8_output_diff']:.2e}"
        )
    print(
        f"max |grouped - loop| output: {result['max_output_diff']:.2e}; grouped padding: {result['routed_rows']} "
        f"routed rows computed as {padded} (groups padded to {align} rows)"
    )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
