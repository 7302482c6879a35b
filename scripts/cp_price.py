"""The planner's price of context parallelism for the shipped 8B / 70B / 405B configs at long sequences.

    python scripts/cp_price.py                                     # 32k, 64k, 128k x cp 1, 2, 4, 8, 16
    python scripts/cp_price.py --configs configs/llama3_8b.toml --seq-lens 131072 --cps 4,8
    python scripts/cp_price.py --methods allgather,alltoall,ring   # each context-parallel method side by side
    python scripts/cp_price.py --configs configs/deepseek_v3_671b.toml --methods allgather,ring \
        --extra "--parallelism.pipeline_parallel_schedule 1F1B"      # MLA's latent ring (DualPipeV refuses cp)

Each config keeps its own layout (tp, pp, schedule, AC, world size) with ``training.seq_len`` set, one sequence
per data-parallel rank and microbatch, ``model.max_seq_len`` raised to fit, and ``context_parallel_degree`` taken
from dp_shard (the world size is fixed). Per row: the size of one K (or V) all-gather, CP's wire bytes per block
and microbatch (2 all-gathers forward + 2 reduce-scatters backward, more under full AC), CP's time per step and the
part of it exposed (the all-gather-KV attention does not overlap it), the share of the step, activation memory per
rank, whether the rank fits, and MFU. With ``--methods`` (parallelism.context_parallel_method) each row is one method
and its columns: the K/V one layer's attention holds per rank (``cp_kv_bytes``), the bytes a rank sends per block
and microbatch, the cp time exposed, the step, activations, fits, MFU. Illegal layouts print their first violation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike.config import model_args_from_config, parse_config  # noqa: E402
from titanlike.errors import ConfigError  # noqa: E402
from titanlike.planner import hardware_for, make_plan  # noqa: E402
from titanlike.planner.cost import messages  # noqa: E402
from titanlike.planner.memory import cp_kv_bytes  # noqa: E402
from titanlike.planner.plan import fmt_bytes, fmt_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORLD = {"llama3_8b": 64, "llama3_70b": 256, "llama3_405b": 16384, "deepseek_v3_671b": 1024, "gpt_oss_120b": 128}
GiB = 2**30


HYBRID_A2A = 2  # the method "hybrid": all-to-all groups of 2 cp ranks, a ring across cp / 2 of them (from cp 4)


def _plan(config: Path, seq: int, cp: int, vocab: int, world: int, method: str = "allgather", ac: str = "", extra=()):
    cfg = parse_config(
        [
            "--job.config_file",
            str(config),
            "--training.seq_len",
            str(seq),
            "--model.max_seq_len",
            str(max(seq, 8192)),
            "--parallelism.context_parallel_degree",
            str(cp),
            "--training.global_batch_size",
            "-1",
            *(("--parallelism.context_parallel_method", method) if cp > 1 else ()),
            *(("--parallelism.context_parallel_a2a_degree", str(HYBRID_A2A)) if method == "hybrid" else ()),
            *(("--activation_checkpoint.mode", ac) if ac else ()),
            *extra,
        ]
    )
    if cfg.parallelism.pipeline_parallel_degree == 1:
        cfg.training.local_batch_size = 1
    args = model_args_from_config(cfg, vocab)
    hw = hardware_for("H100", gpus_per_node=8, dtype=cfg.training.dtype)
    return make_plan(cfg, world, hw, args, run_dry=False), args


def _per_block(plan, args) -> float:
    """Bytes rank 0 puts on the wire for cp per softmax block and microbatch pass (all phases)."""
    lo = plan.layout
    cp_msgs = [m for m in messages(lo, args, 0) if m.dim == "cp"]
    blocks = sum(1 for sid in lo.stage_ids(0) for n in lo.stages[sid] if n.startswith("layers."))
    return sum(m.wire_bytes for m in cp_msgs) / max(blocks * lo.accum_steps * lo.n_microbatches, 1)


def method_row(config: Path, seq: int, cp: int, vocab: int, world: int, method: str, ac: str = "", extra=()) -> str:
    plan, args = _plan(config, seq, cp, vocab, world, method, ac, extra)
    head = f"{config.stem:<12}{seq:>8,}{cp:>4} {method:<10}"
    if not plan.legal:
        return f"{head}  illegal: {plan.violations[0][:90]}"
    lo, c = plan.layout, plan.cost
    d = c.dims.get("cp")
    act = next(it.bytes for it in plan.memory[0] if it.name == "activations")
    kv = cp_kv_bytes(lo, args) if cp > 1 else cp_kv_bytes(lo, args, "allgather")
    return (
        f"{head}{lo.dp_shard:>6}  {fmt_bytes(kv):>10}  {fmt_bytes(_per_block(plan, args)):>10}  "
        f"{fmt_seconds(d.exposed if d else 0):>9}  {fmt_seconds(c.step_time):>9}  {act / GiB:8.1f}  "
        f"{'yes' if plan.fits else 'NO':>4}  {c.mfu:5.1%}"
    )


def row(config: Path, seq: int, cp: int, vocab: int, world: int, extra=()) -> str:
    plan, args = _plan(config, seq, cp, vocab, world, extra=extra)
    head = f"{config.stem:<12}{seq:>8,}{cp:>4}"
    if not plan.legal:
        return f"{head}  illegal: {plan.violations[0][:90]}"
    lo, c = plan.layout, plan.cost
    cp_msgs = [m for m in messages(lo, args, 0) if m.dim == "cp"]
    one = max((m.nbytes for m in cp_msgs), default=0)
    blocks = sum(1 for sid in lo.stage_ids(0) for n in lo.stages[sid] if n.startswith("layers."))
    passes = lo.accum_steps * lo.n_microbatches
    per_block = sum(m.wire_bytes for m in cp_msgs) / max(blocks * passes, 1)
    d = c.dims.get("cp")
    act = next(it.bytes for it in plan.memory[0] if it.name == "activations")
    return (
        f"{head}{lo.dp_shard:>6}  {fmt_bytes(one):>10}  {fmt_bytes(per_block):>10}  "
        f"{fmt_seconds(d.seconds if d else 0):>9}  {fmt_seconds(d.exposed if d else 0):>9}  "
        f"{(d.exposed if d else 0) / c.step_time:6.1%}  {fmt_seconds(c.step_time):>9}  {act / GiB:8.1f}  "
        f"{'yes' if plan.fits else 'NO':>4}  {c.mfu:5.1%}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="configs/llama3_8b.toml,configs/llama3_70b.toml,configs/llama3_405b.toml")
    ap.add_argument("--seq-lens", default="32768,65536,131072")
    ap.add_argument("--cps", default="1,2,4,8,16")
    ap.add_argument(
        "--methods", default="", help="comma-separated cp methods: one row each (allgather,alltoall,ring,hybrid: a2a 2)"
    )
    ap.add_argument(
        "--ac", default="", help="activation_checkpoint.mode for the --methods rows (default: the config's)"
    )
    ap.add_argument("--extra", default="", help="more config overrides, e.g. a pipeline schedule cp supports")
    a = ap.parse_args(argv)
    extra = a.extra.split()
    methods = [m for m in a.methods.split(",") if m]
    from titanlike.data import build_tokenizer

    print(
        "CP price per step on H100 nodes of 8 (titanlike planner; rank 0; K/V in bf16). One sequence per dp rank "
        "and microbatch; world size fixed, dp_shard = what is left."
    )
    if methods:
        print(
            f"{'config':<12}{'seq':>8}{'cp':>4} {'method':<10}{'dp_sh':>6}  {'K/V layer':>10}  {'cp wire/blk':>10}  "
            f"{'exposed':>9}  {'step':>9}  {'act GiB':>8}  {'fits':>4}  {'MFU':>5}"
        )
    else:
        print(
            f"{'config':<12}{'seq':>8}{'cp':>4}{'dp_sh':>6}  {'K or V msg':>10}  {'cp wire/blk':>10}  {'cp time':>9}  "
            f"{'exposed':>9}  {'share':>6}  {'step':>9}  {'act GiB':>8}  {'fits':>4}  {'MFU':>5}"
        )
    for path in a.configs.split(","):
        config = ROOT / path if not Path(path).is_absolute() else Path(path)
        try:
            base = parse_config(["--job.config_file", str(config)])
            vocab = build_tokenizer(base.model.tokenizer).vocab_size
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        world = WORLD.get(config.stem, 64)
        for seq in map(int, a.seq_lens.split(",")):
            for cp in map(int, a.cps.split(",")):
                if not methods:
                    print(row(config, seq, cp, vocab, world, extra), flush=True)
                for method in methods if cp > 1 else methods[:1]:
                    print(method_row(config, seq, cp, vocab, world, method, a.ac, extra), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
