#!/usr/bin/env bash
# The prepared single-GPU check: the side-by-side benchmark rows and a short train.py run of the 1B config, each
# with its own timeout, all inside a total budget (default 450 s, under 8 minutes), JSON under $OUT.
#
#   bash scripts/gpu_check.sh [--wheels DIR|none] [--device cuda|cpu] [--budget SECONDS]
#
#   --wheels DIR   pip install --no-deps the torchdata / torchao wheels found in DIR (default: $WHEELS; unset or
#                  "none": install nothing). For a GPU machine that reaches no package registry, carry the wheels
#                  there with the working tree and name their folder.
#   --device cpu   dry mode (what the test suite runs, so the script cannot rot): the tiny model, 2 steps, no
#                  compile, float8 through torchao's emulation, train.py on the debug config for 3 steps.
#
# Rows (benchmark.py; "plain" is timed once per batch size and shared by the rows of that batch size):
#   bf16_b4          titanlike (compile, no FSDP wrapper, chunked loss) vs plain, batch 4 x 2048
#   bf16_b8          the same at batch 8
#   bf16_b8_ac_op    titanlike with selective op-level AC at batch 8 (what AC buys when it lets the batch grow)
#   float8_tw_b4     titanlike + torchao float8 tensorwise, batch 4      (ratio against plain b4)
#   float8_rw_b4     titanlike + torchao float8 rowwise, batch 4         (ratio against plain b4)
#   fsdp_on_b4       titanlike under the FSDP2 wrapper on one rank, b4   (ratio against plain b4)
#   train_1b         python train.py --job.config_file configs/llama3_1b.toml, 30 steps (b4 x 2048, compile)
#   moe_bench        scripts/moe_bench.py: one MoE layer (Qwen3-30B-A3B shape, bf16), torch._grouped_mm vs a
#                    per-expert loop vs torchao's float8 grouped GEMM (--float8), side by side
#                    ($OUT/moe_bench/moe_bench.json; "moe" in summary.json)
#   muon_step        scripts/muon_bench.py: the 1B model's optimizer step, Muon (bf16 Newton-Schulz) vs AdamW, one GPU
#                    (dry mode: 2 gloo ranks, tiny, with the naive every-rank Muon beside it)
#   mask_bench       scripts/mask_bench.py: attention fwd+bwd, block_causal (FlexAttention block mask, compiled) vs
#                    causal on the same batch, a 128-token sliding window with and without sinks (FlexAttention's
#                    window block mask, sinks from its log-sum-exp: the CUDA path CPU CI runs forward only), and the
#                    shipped corpus's skipped share ($OUT/mask_bench/mask.json; "mask")
#   train_gpt_oss    python train.py --model.name gpt_oss --model.flavor debugmodel, block_causal, 10 steps (window 32,
#                    sinks, compiled blocks: flex's window + documents block mask and the sinks' backward on a GPU)
#   deepseek_v3      benchmark.py --model deepseek_v3 (debugmodel: MLA, DeepSeek MoE, one MTP depth), titanlike vs
#                    plain on CUDA: the MLA path (v head dim != q/k head dim) through SDPA and the grouped experts
#                    ($OUT/deepseek_v3/deepseek_v3.json; "deepseek_v3" in summary.json)
#   linear_bench     scripts/linear_attention_bench.py: Gated DeltaNet fwd+bwd, chunked vs recurrent (vs the
#                    flash-linear-attention kernel when installed), Qwen3-Next's cp bytes per layer kind, the scan on 2
#                    gloo ranks ($OUT/linear_bench/linear.json; "linear" in summary.json)
#   memory_modes     scripts/memory_modes.py: peak memory per rank of fsdp2 / ddp2 / ZeRO-1 / fsdp2 + CPU offload / fsdp2
#                    + activation offload on 2 gloo ranks (the host's CPU on every machine: one GPU holds no two NCCL
#                    ranks), beside the planner's device / host figures ($OUT/memory_modes/modes.json)
#   act_offload      scripts/memory_modes.py --one-device cuda: one process, the 1B model in bf16 at 1 x 2048, the CUDA
#                    allocator's peak with no offload / activation offload / full AC / offload + AC every 2
#                    ($OUT/memory_modes/one_device.json; "memory_modes" in summary.json)
#   cp_methods       scripts/cp_memory.py: each context-parallel method's (allgather, alltoall, ring, hybrid)
#                    activation memory per rank and bytes sent per layer at cp 1 and 4 (hybrid: all-to-all groups of 2,
#                    a ring of 2), on gloo CPU ranks beside the GPU (one GPU cannot host a multi-rank NCCL group);
#                    $OUT/cp_methods.log
#   host_reads       scripts/host_reads_step.py: train.py's steps (the 1B config, compiled blocks, fused AdamW, 7 steps
#                    logging at 1 and 7) with every device-to-host read counted per step and named: the steps between
#                    the log steps must read nothing, the precondition of capturing a step as a CUDA graph
#                    ($OUT/host_reads/reads.json)
#   pp_uneven        scripts/plan.py: DeepSeek-V3 671B's 61 layers split unevenly over 8 pipeline stages (the planner's
#                    split line; no device)
# Writes $OUT/<row>.json (benchmark.py --json), $OUT/<row>.log, $OUT/train_1b/metrics.jsonl, $OUT/moe_bench/moe_bench.json,
# $OUT/muon_step/muon.json, $OUT/mask_bench/mask.json, $OUT/linear_bench/linear.json, $OUT/env.json and $OUT/summary.json (every row's tokens/s, MFU,
# memory and ratio to plain, the MoE ratio, Muon's step seconds against AdamW's, the mask ratio, and each step's exit
# code).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/gpu-check-out}
WHEELS=${WHEELS:-}
DEVICE=cuda
BUDGET=450
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (use --wheels DIR|none, --device cuda|cpu, --budget S, --out DIR)" >&2
       exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check.sh: --device must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac
mkdir -p "$OUT"
START=$SECONDS

if [ -n "$WHEELS" ] && [ "$WHEELS" != none ]; then
  wheels=$(ls "$WHEELS"/torchdata-*.whl "$WHEELS"/torchao-*.whl 2>/dev/null)
  if [ -n "$wheels" ]; then
    # --no-deps: never let pip touch the machine's torch
    python -m pip install --no-deps -q $wheels > "$OUT/pip.log" 2>&1; echo "== pip install --no-deps (rc $?): $wheels"
  else
    echo "== no torchdata/torchao wheels in $WHEELS"
  fi
fi

python - "$OUT/env.json" "$DEVICE" <<'EOF'
import json, sys, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": sys.argv[2]}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["capability"] = list(torch.cuda.get_device_capability(0))
    info["memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
for mod in ("torchao", "torchdata", "liger_kernel"):
    try:
        info[mod] = __import__(mod).__version__
    except Exception as e:  # noqa: BLE001
        info[mod] = f"missing ({type(e).__name__})"
json.dump(info, open(sys.argv[1], "w"), indent=1)
print("==", json.dumps(info))
EOF

if [ "$DEVICE" = cuda ]; then
  COMMON=(--flavor 1B --seq-len 2048 --steps 15 --warmup 4 --compile --loss-chunk 2048 --device cuda)
  F8=()
  B4=4; B8=8; T_FIRST=150; T_ROW=100; T_TRAIN=170
  MOE=(--device cuda --float8)
  MUON=(--world 1 --device cuda --flavor 1B --dim 0 --layers 0 --ns-dtype bfloat16 --steps 5); T_MUON=90
  MASK=(--device cuda)
  DS=(--model deepseek_v3 --flavor debugmodel --seq-len 2048 --batch 8 --steps 10 --warmup 3 --compile --device cuda)
  LINEAR=(--device cuda --seq 4096 --steps 2 --warmup 1)
  MODES=(--seq-len 256 --local-batch 4 --steps 2)
  ONE_DEV=(--one-device cuda --config configs/llama3_1b.toml --seq-len 2048 --local-batch 1 --steps 2 --dtype bfloat16
           --vocab 128256)
  CP=(--seq-len 8192 --cps 1,4)
  TRAIN=(--job.config_file configs/llama3_1b.toml --training.steps 30 --training.local_batch_size 4
         --training.global_batch_size 4 --training.seq_len 2048 --compile.enable true --metrics.log_freq 10
         --validation.enable false --checkpoint.enable false --metrics.enable_tensorboard false)
  GPT_OSS=(--job.config_file configs/debug_model.toml --model.name gpt_oss --model.flavor debugmodel
           --model.attn_mask_type block_causal --training.steps 10 --training.dtype bfloat16 --compile.enable true
           --metrics.log_freq 1 --validation.enable false --checkpoint.enable false --metrics.enable_tensorboard false)
  HOST=(--job.config_file configs/llama3_1b.toml --training.steps 7 --training.local_batch_size 4
        --training.global_batch_size 4 --training.seq_len 2048 --compile.enable true --checkpoint.enable false
        --metrics.enable_tensorboard false)
else
  COMMON=(--flavor tiny --seq-len 32 --steps 2 --warmup 1 --loss-chunk 16 --device cpu)
  F8=(--float8-emulate)
  B4=2; B8=4; T_FIRST=300; T_ROW=300; T_TRAIN=300  # generous: a shared 2-core CI machine
  MOE=(--device cpu --tokens 64 --dim 16 --hidden 32 --experts 4 --steps 1 --warmup 0)
  MUON=(--world 2 --device cpu --flavor tiny --dim 0 --layers 0 --steps 1); T_MUON=300
  MASK=(--device cpu --seq-len 256 --batch 1 --heads 2 --head-dim 16 --doc-len 64 --steps 1 --warmup 0)
  DS=(--model deepseek_v3 --flavor debugmodel --seq-len 32 --batch 2 --steps 2 --warmup 1 --device cpu)
  LINEAR=(--device cpu --seq 48 --heads 2 --dk 8 --dv 8 --chunk 16 --steps 1 --warmup 0 --scan-reps 2)
  MODES=(--seq-len 32 --local-batch 2 --steps 1)
  ONE_DEV=(--one-device cpu --seq-len 32 --local-batch 2 --steps 1)
  CP=(--seq-len 64 --cps 4)
  TRAIN=(--job.config_file configs/debug_model.toml --training.steps 3 --training.seq_len 32 --training.device cpu
         --training.local_batch_size 2 --metrics.log_freq 1 --validation.enable false
         --metrics.enable_tensorboard false)
  GPT_OSS=(--job.config_file configs/debug_model.toml --model.name gpt_oss --model.flavor debugmodel
           --model.attn_mask_type block_causal --training.steps 2 --training.seq_len 64 --training.device cpu
           --training.local_batch_size 2 --metrics.log_freq 1 --validation.enable false
           --metrics.enable_tensorboard false)
  HOST=(--job.config_file configs/debug_model.toml --training.seq_len 32 --training.device cpu
        --training.local_batch_size 2 --metrics.enable_tensorboard false)
fi
# the uneven pipeline split (the planner, no device): DeepSeek-V3 671B's 61 layers on 8 stages, 512 GPUs (on 256 the
# planner validates the layout but the stages' memory does not fit an H100: exit 1)
PLAN=(--world-size 512 --job.config_file configs/debug_model.toml --model.name deepseek_v3 --model.flavor 671B
      --parallelism.pipeline_parallel_degree 8 --parallelism.expert_parallel_degree 32 --training.local_batch_size 8
      --training.global_batch_size 512 --no-dry-run)

declare -A RC
run() {  # name, timeout, command...: bounded by what is left of the budget
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 10 ]; then RC[$name]=skipped; echo "== $name skipped: budget spent"; return; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  RC[$name]=$?
  echo "== $name (rc ${RC[$name]}, ${limit}s limit, $((SECONDS - START))s so far)"; tail -3 "$OUT/$name.log"
}
bench() { local name=$1 limit=$2; shift 2; run "$name" "$limit" python scripts/benchmark.py "${COMMON[@]}" --json "$OUT/$name.json" "$@"; }

bench bf16_b4 "$T_FIRST" --batch "$B4"
bench bf16_b8 "$T_ROW" --batch "$B8"
bench float8_tw_b4 "$T_ROW" --batch "$B4" --only titanlike --float8 tensorwise "${F8[@]}"
bench float8_rw_b4 "$T_ROW" --batch "$B4" --only titanlike --float8 rowwise "${F8[@]}"
bench fsdp_on_b4 "$T_ROW" --batch "$B4" --only titanlike --fsdp on
run train_1b "$T_TRAIN" python train.py "${TRAIN[@]}" --job.dump_folder "$OUT/train_1b"
bench bf16_b8_ac_op "$T_ROW" --batch "$B8" --only titanlike --ac op
run moe_bench "$T_ROW" python scripts/moe_bench.py "${MOE[@]}" --json "$OUT/moe_bench/moe_bench.json"
mkdir -p "$OUT/muon_step"
run muon_step "$T_MUON" python scripts/muon_bench.py "${MUON[@]}" --json "$OUT/muon_step/muon.json"
run mask_bench "$T_ROW" python scripts/mask_bench.py "${MASK[@]}" --json "$OUT/mask_bench/mask.json"
run train_gpt_oss "$T_ROW" python train.py "${GPT_OSS[@]}" --job.dump_folder "$OUT/train_gpt_oss"
mkdir -p "$OUT/deepseek_v3"
run deepseek_v3 "$T_ROW" python scripts/benchmark.py "${DS[@]}" --json "$OUT/deepseek_v3/deepseek_v3.json"
mkdir -p "$OUT/linear_bench"
run linear_bench "$T_ROW" python scripts/linear_attention_bench.py "${LINEAR[@]}" --json "$OUT/linear_bench/linear.json"
mkdir -p "$OUT/memory_modes"
run memory_modes "$T_ROW" python scripts/memory_modes.py "${MODES[@]}" --json "$OUT/memory_modes/modes.json"
run act_offload "$T_ROW" python scripts/memory_modes.py "${ONE_DEV[@]}" --json "$OUT/memory_modes/one_device.json"
run cp_methods "$T_ROW" python scripts/cp_memory.py "${CP[@]}" --methods allgather,alltoall,ring,hybrid
mkdir -p "$OUT/host_reads"
run host_reads "$T_ROW" python scripts/host_reads_step.py "${HOST[@]}" --job.dump_folder "$OUT/host_reads" \
    --json "$OUT/host_reads/reads.json"
run pp_uneven "$T_ROW" python scripts/plan.py "${PLAN[@]}"

rcs=""; for k in "${!RC[@]}"; do rcs="$rcs$k=${RC[$k]} "; done
python - "$OUT" "$rcs" <<'EOF'
import json, sys
from pathlib import Path
out, rcs = Path(sys.argv[1]), dict(kv.split("=") for kv in sys.argv[2].split())
rows, plain = [], {}
for f in sorted(out.glob("*.json")):
    if f.name in ("env.json", "summary.json"):
        continue
    d = json.loads(f.read_text())
    for r in d["rows"]:
        if r["name"] == "plain":
            plain[d["args"]["batch"]] = r["tokens_per_s"]
for f in sorted(out.glob("*.json")):
    if f.name in ("env.json", "summary.json"):
        continue
    d = json.loads(f.read_text())
    for r in d["rows"]:
        if r["name"] != "titanlike":
            continue
        base = plain.get(d["args"]["batch"])
        rows.append({"row": f.stem, "batch": d["args"]["batch"], "float8": d["args"]["float8"] or None,
                     "fsdp": d["args"]["fsdp"], "ac": d["args"]["ac"], "tokens_per_s": r["tokens_per_s"],
                     "mfu": r["mfu"], "peak_mem_gib": r["peak_mem_gib"], "loss": r["loss"],
                     "plain_tokens_per_s": base, "ratio_to_plain": r["tokens_per_s"] / base if base else None})
def metrics(run):
    m = out / run / "metrics.jsonl"
    return [json.loads(line) for line in m.read_text().splitlines() if line.strip()] if m.exists() else []
train, gpt_oss = metrics("train_1b"), metrics("train_gpt_oss")
moe = out / "moe_bench" / "moe_bench.json"
muon = out / "muon_step" / "muon.json"
muon = json.loads(muon.read_text()) if muon.exists() else None
mask = out / "mask_bench" / "mask.json"
mask = json.loads(mask.read_text()) if mask.exists() else None
ds = out / "deepseek_v3" / "deepseek_v3.json"
ds = json.loads(ds.read_text()) if ds.exists() else None
linear = out / "linear_bench" / "linear.json"
linear = json.loads(linear.read_text()) if linear.exists() else None
reads = out / "host_reads" / "reads.json"
reads = [{"step": r["step"], "reads": len(r["reads"]), "seconds": r["seconds"], "first": r["reads"][:1]}
         for r in json.loads(reads.read_text())["steps"]] if reads.exists() else None
modes = {k: json.loads((out / "memory_modes" / f"{k}.json").read_text())
         for k in ("modes", "one_device") if (out / "memory_modes" / f"{k}.json").exists()}
summary = {"env": json.loads((out / "env.json").read_text()), "exit_codes": rcs, "rows": rows,
           "plain_tokens_per_s_by_batch": plain, "train_1b": [r for r in train if "loss" in r],
           "moe": json.loads(moe.read_text()) if moe.exists() else None, "muon_step": muon, "mask": mask,
           "train_gpt_oss": [r for r in gpt_oss if "loss" in r],
           "deepseek_v3": ds, "linear": linear, "memory_modes": modes, "host_reads": reads}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"{'row':<16} {'batch':>5} {'tokens/s':>10} {'MFU':>6} {'mem GiB':>8} {'x plain':>8}")
for r in rows:
    mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    ratio = "n/a" if r["ratio_to_plain"] is None else f"{r['ratio_to_plain']:.3f}"
    print(f"{r['row']:<16} {r['batch']:>5} {r['tokens_per_s']:>10,.0f} {mfu:>6} {r['peak_mem_gib']:>8.2f} {ratio:>8}")
print("plain tokens/s by batch:", {k: round(v) for k, v in plain.items()})
if summary["train_1b"]:
    last = summary["train_1b"][-1]
    print(f"train_1b: step {last['step']} loss {last['loss']:.4f} tokens/s {last.get('tokens_per_s', 0):,.0f}")
if summary["moe"]:
    if "ratio_fp8_over_grouped" in summary["moe"]:
        print(f"moe_bench: float8 grouped/grouped {summary['moe']['ratio_fp8_over_grouped']:.3f}, "
              f"max |fp8 - loop| {summary['moe']['max_fp8_output_diff']:.2e}")
    print(f"moe_bench: grouped/loop {summary['moe']['ratio_grouped_over_loop']:.3f}",
          {k: round(v["tokens_per_s"]) for k, v in summary["moe"]["rows"].items()})
if muon:
    secs = {k: round(v["seconds"], 4) for k, v in muon["rows"].items()}
    print(f"muon_step: optimizer step seconds {secs}; muon / adamw {secs['muon'] / secs['adamw']:.2f}")
if mask:
    print(f"mask_bench: block_causal / causal {mask['ratio_block_causal_over_causal']:.3f} ({mask['backend']}),",
          f"corpus FLOPs skipped {mask['corpus']['flops_skipped']:.4%}" if mask["corpus"] else "")
    print(f"mask_bench: window / causal {mask['ratio_window_over_causal']:.3f} (keeps "
          f"{mask['window_pair_fraction']:.4f} of the pairs), with sinks {mask['ratio_window_sinks_over_causal']:.3f}")
if summary["train_gpt_oss"]:
    print("train_gpt_oss: losses", [round(r["loss"], 4) for r in summary["train_gpt_oss"]])
if linear:
    print("linear_bench: tokens/s", {k: round(v["tokens_per_s"]) for k, v in linear["forms"]["rows"].items()},
          "max diff vs recurrent", linear["forms"]["max_output_diff_vs_recurrent"])
for k, m in modes.items():
    print(f"memory_modes {k} ({m['device']}): peak MiB",
          {f"{r['mode']} r{r['rank']}": round(r["Total"], 1) for r in m["rows"]})
print("exit codes:", rcs)
EOF
echo "== gpu_check done in $((SECONDS - START))s; results in $OUT"
