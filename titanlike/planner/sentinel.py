"""The price of one silent-corruption check (``training.sdc_check_interval``, titanlike/training/sentinel.py) on a
rank: per group of ranks that hold the same state, one all-reduce of two fingerprints (five int64 numbers each) per
tensor, and one 8-byte all-reduce over the job. A tensor is a parameter's local shard and each of its AdamW moments
(3 per parameter; Muon keeps one momentum for its matrices, priced the same). Measured equal to the trainer's own
count (``sdc_check_bytes`` in metrics.jsonl) by tests/fault/test_sentinel.py."""

from __future__ import annotations

from dataclasses import dataclass

from titanlike.parallel.replica_check import FINGERPRINT
from titanlike.planner.memory import rank_param_shards

STATES = 3  # a parameter, AdamW's exp_avg and exp_avg_sq


@dataclass
class SdcPrice:
    groups: list[tuple[str, int]]  # (what, tensors compared)
    bytes: int  # what this rank sends into the check's all-reduces


def sdc_price(cfg, lo, args, rank: int) -> SdcPrice:
    shards = [s for stage in rank_param_shards(lo, args, rank).values() for s in stage]
    groups: list[tuple[str, int]] = []
    if lo.dims.dp_replicate > 1:
        groups.append(("dp_replicate", STATES * len(shards)))
    if lo.tp > 1:
        replicated = [s for s in shards if not s.group and s.tp_shape == s.shape]
        if replicated:
            groups.append(("tp", STATES * len(replicated)))
    c = lo.coords(rank)
    ends = {0, len(lo.stages) - 1}
    if lo.pp > 1 and getattr(args, "tie_embeddings", False) and not lo.v_placement:
        if ends & set(lo.stage_ids(c["pp"])):
            groups.append(("pp (tied copies)", STATES))
    sent = sum(2 * n * FINGERPRINT * 8 for _, n in groups)
    ft = cfg.fault_tolerance
    if ft.enable and ft.semi_sync_method == "none":
        n = STATES * len(shards)
        groups.append((f"{ft.group_size} replica groups", n))
        sent += (n + 1) * FINGERPRINT * 8 * ft.group_size
    return SdcPrice(groups, sent + 8)
