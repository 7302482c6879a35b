"""Plan a layout before allocating a GPU: validation, rank map, price per step, memory per rank, dry run.

    python scripts/plan.py --job.config_file configs/llama3_405b.toml --world-size 16384 --gpus-per-node 8 \\
        [--gpu H100] [--nvlink-gbps 450 --ib-gbps 50] [--suggest] [--section.key value ...]

Options with a dot (``--parallelism.tensor_parallel_degree 16``) override the config as for train.py; the others
describe the machine and the report. Exit code: 0 legal and fits, 1 legal but over the memory budget,
2 a configuration error or layout violation. docs/planner.md explains every number.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike.config import model_args_from_config, parse_config  # noqa: E402
from titanlike.errors import ConfigError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any --section.key value is a config override (see titanlike/config.py).",
    )
    p.add_argument("--world-size", type=int, required=True, help="number of GPUs (ranks) of the job")
    p.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs per node (default: parallelism.gpus_per_node, else 8)"
    )
    p.add_argument("--gpu", default="H100", help="GPU type: A100, H100, H200, B200 (default H100)")
    p.add_argument("--nvlink-gbps", type=float, help="intra-node bandwidth per GPU and direction, GB/s")
    p.add_argument("--ib-gbps", type=float, help="inter-node bandwidth per GPU and direction, GB/s")
    p.add_argument("--memory-gib", type=float, help="GPU memory, GiB")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="dense peak TFLOP/s per GPU (default: metrics.peak_tflops, else the MFU table)",
    )
    p.add_argument(
        "--compute-efficiency",
        type=float,
        default=0.6,
        help="fraction of the peak the kernels reach when nothing waits (default 0.6)",
    )
    p.add_argument("--latency-us", type=float, default=10.0, help="latency per message, microseconds")
    p.add_argument("--rank", type=int, default=0, help="the rank the price, memory and dry run are shown for")
    p.add_argument("--no-dry-run", action="store_true", help="skip the fake-process-group dry run")
    p.add_argument(
        "--attention-fraction",
        type=float,
        help="block_causal: the share of the causal attention tiles the mask computes (default: measured on the "
        "config's corpus, titanlike.data.documents)",
    )
    p.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        help="mixture of experts: the busiest expert-parallel rank's tokens over the mean (default 1: balanced); "
        "scales its all-to-all bytes and expert FLOPs",
    )
    p.add_argument("--suggest", action="store_true", help="also rank the legal layouts for this model and world size")
    p.add_argument("--top", type=int, default=12, help="suggested layouts to show (default 12)")
    return p


def corpus_attention_fraction(cfg) -> float:
    """The block-causal mask's share of the causal attention tiles (FlexAttention's 128 x 128) on the config's corpus
    (data.path, or the shipped one), at training.seq_len, as the data pipeline reports it."""
    from titanlike.data import build_tokenizer, load_token_stream, shipped_corpus
    from titanlike.data.documents import document_stats

    tok = build_tokenizer(cfg.model.tokenizer)
    tokens = load_token_stream(cfg.data.path or shipped_corpus(), tok, cfg.data.text_field, cfg.data.encoding)
    stats = document_stats(tokens, tok.eos_id, cfg.training.seq_len)
    print(f"attention: block_causal on the corpus: {stats.describe()}", flush=True)
    return stats.block_fraction


def main(argv: list[str] | None = None) -> int:
    opts, config_argv = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    from titanlike.planner import hardware_for, make_plan, render_plan

    try:
        cfg = parse_config(config_argv)
        from titanlike.data import build_tokenizer

        try:
            vocab = build_tokenizer(cfg.model.tokenizer).vocab_size
        except (ValueError, OSError) as e:
            raise ConfigError(f"model.tokenizer: {e}") from None
        args = model_args_from_config(cfg, vocab)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if opts.world_size < 1:
        print(f"config error: --world-size must be >= 1, got {opts.world_size}", file=sys.stderr)
        return 2
    try:
        hw = hardware_for(
            opts.gpu,
            gpus_per_node=opts.gpus_per_node or cfg.parallelism.gpus_per_node or 8,
            dtype=cfg.training.dtype,
            float8_recipe=cfg.float8.recipe,
            peak_tflops=opts.peak_tflops or cfg.metrics.peak_tflops,
            nvlink_gbps=opts.nvlink_gbps,
            ib_gbps=opts.ib_gbps,
            memory_gib=opts.memory_gib,
            compute_efficiency=opts.compute_efficiency,
            latency_us=opts.latency_us,
        )
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if not 0 <= opts.rank < opts.world_size:
        print(f"config error: --rank {opts.rank} is not in [0, {opts.world_size})", file=sys.stderr)
        return 2
    fraction = opts.attention_fraction
    if fraction is None:
        fraction = corpus_attention_fraction(cfg) if cfg.model.attn_mask_type == "block_causal" else 1.0
    try:
        plan = make_plan(
            cfg,
            opts.world_size,
            hw,
            args,
            rank=opts.rank,
            run_dry=not opts.no_dry_run,
            attention_fraction=fraction,
            expert_imbalance=opts.expert_imbalance,
        )
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(render_plan(plan), flush=True)
    if opts.suggest:
        print()
        print(render_suggestions(plan, opts.top))
    if not plan.legal:
        return 2
    return 0 if plan.fits else 1


def render_suggestions(plan, top: int) -> str:
    from titanlike.planner import fmt_bytes, suggest_layouts
    from titanlike.planner.plan import fmt_seconds

    cfg, ws = plan.cfg, plan.world_size
    if plan.layout is not None:
        gbs = plan.layout.global_batch
    else:
        p, t = cfg.parallelism, cfg.training
        rest = (
            p.tensor_parallel_degree
            * p.pipeline_parallel_degree
            * p.context_parallel_degree
            * p.data_parallel_replicate_degree
        )
        gbs = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * max(1, ws // rest)
    found, stats = suggest_layouts(cfg, ws, plan.hardware, plan.args, global_batch=gbs)
    lines = [
        f"== suggest: layouts of {cfg.model.flavor} on {ws:,} x {plan.hardware.gpu} for {gbs:,} x "
        f"{cfg.training.seq_len:,} tokens per step, fastest first",
        f"  {stats['layouts']} layouts considered: {stats['illegal']} illegal, {stats['out of memory']} over "
        f"memory even with full AC, {len(found)} fit",
        f"  {'#':>3} {'tp':>3} {'pp':>3} {'dp_sh':>6} {'dp_rep':>6} {'schedule':<19}{'mb':>3}{'acc':>4}  "
        f"{'AC':<13}{'memory':>11}  {'step':>9}  {'MFU':>6}  {'bubble':>6}",
    ]
    if cfg.parallelism.context_parallel_degree > 1:  # each layout with every cp method: which one is shown
        lines[-1] += f"  {'cp method':<10}"
    for i, c in enumerate(found[:top], 1):
        sched = f"{c.schedule} v{c.stages_per_rank}" if c.pp > 1 else "-"
        lines.append(
            f"  {i:>3} {c.tp:>3} {c.pp:>3} {c.dp_shard:>6} {c.dp_replicate:>6} {sched:<19}{c.microbatch:>3}"
            f"{c.accum_steps:>4}  {c.ac:<13}{fmt_bytes(c.memory):>11}  {fmt_seconds(c.step_time):>9}  "
            f"{c.mfu:>6.1%}  {c.bubble:>6.3f}{f'  cp {c.cp} {c.cp_method:<10}' if c.cp > 1 else ''}"
            f"{'  TP ACROSS NODES' if c.tp_spans_nodes else ''}"
        )
    crossing = [c for c in found if c.tp_spans_nodes]
    if crossing and all(c.tp_spans_nodes is False for c in found[:top]):
        best = crossing[0]
        lines.append(
            f"  best layout with tp across nodes: tp {best.tp} x pp {best.pp}, {fmt_seconds(best.step_time)} "
            f"(#{found.index(best) + 1}) -- TP ACROSS NODES"
        )
    if found:
        lines.append(f"  #1 as overrides: {' '.join(found[0].overrides)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
