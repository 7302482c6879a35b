"""The decisions a layout implies, each answered in one place: precision, FSDP resharding, activation
checkpointing per block, and the batch split. The trainer, the parallelize functions and the planner all ask here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titanlike.errors import ConfigError

__all__ = [
    "BatchSplit",
    "ac_block_mode",
    "batch_split",
    "canonical_microbatch_size",
    "loss_parallel_enabled",
    "master_dtype",
    "parse_ac_option",
    "precision_policy",
    "reshard_after_forward",
    "virtual_dp_degree",
]

Precision = Literal["fsdp", "autocast", "none"]


def precision_policy(dtype: str, degrees, layout_invariant: bool = False) -> Precision:
    """How ``training.dtype`` is realised on a layout.

    ``"fsdp"``: bfloat16 through FSDP2's mixed precision (bf16 parameter copies for compute, float32 gradient
    reduction, float32 master weights), whenever FSDP wraps the model (``degrees.fsdp_wraps``);
    ``"autocast"``: bfloat16 without FSDP: ``torch.autocast`` around each forward over float32 weights, and under
    ``training.layout_invariant`` on every layout (FSDP then gathers the float32 weights: the forward is the one
    process's, op for op);
    ``"none"``: float32 or float64 throughout.
    """
    if dtype != "bfloat16":
        return "none"
    return "fsdp" if degrees.fsdp_wraps and not layout_invariant else "autocast"


def loss_parallel_enabled(cfg, degrees) -> bool:
    """The head's logits stay vocab-sharded and the loss is the vocab-parallel cross entropy: under tensor
    parallelism unless ``parallelism.disable_loss_parallel``."""
    return degrees.tp_enabled and not cfg.parallelism.disable_loss_parallel


def master_dtype(dtype: str) -> str:
    """The dtype parameters, gradients and optimizer states are stored in: float64 for float64 runs, else float32
    (bfloat16 is mixed precision over float32 master weights)."""
    return "float64" if dtype == "float64" else "float32"


RESHARD_CHOICES = ("default", "always", "never")
FSDP_GROUPS = ("block", "embedding", "head", "root")


def reshard_after_forward(policy: str, group: str, pp_enabled: bool) -> bool:
    """Does FSDP free the gathered parameters of ``group`` (one of :data:`FSDP_GROUPS`) after its forward?

    ``"always"``: every group; ``"never"``: none; ``"default"``: blocks and the embedding, except under pipeline
    parallelism (the zero-bubble schedules run weight-gradient passes after FSDP resharded, which loses gradients:
    docs/facts.md, "The zero-bubble resharding trap"; and a resident stage saves one all-gather per microbatch);
    the head and the root never (their backward follows their forward at once).
    """
    if policy not in RESHARD_CHOICES:
        raise ValueError(f"reshard_after_forward must be one of {RESHARD_CHOICES}, got {policy!r}")
    if group not in FSDP_GROUPS:
        raise ValueError(f"FSDP group must be one of {FSDP_GROUPS}, got {group!r}")
    if policy != "default":
        return policy == "always"
    return group in ("block", "embedding") and not pp_enabled


def parse_ac_option(option) -> str | int:
    """``activation_checkpoint.selective_ac_option``: ``"op"`` or a positive integer N (every N-th block), given
    as an int or as its decimal digits. Anything else is a ConfigError."""
    if isinstance(option, int) and not isinstance(option, bool):
        n = option
    elif isinstance(option, str) and option == "op":
        return "op"
    elif isinstance(option, str) and option.isascii() and option.isdigit():
        n = int(option)
    else:
        raise ConfigError(f"activation_checkpoint.selective_ac_option: {option!r} must be 'op' or a positive integer")
    if n < 1:
        raise ConfigError(f"activation_checkpoint.selective_ac_option: {n} must be 'op' or a positive integer")
    return n


def ac_block_mode(mode: str, option, layer_id: int) -> str:
    """How block ``layer_id`` (its global index) is checkpointed: ``"none"``, ``"full"`` or ``"op"``.

    ``mode`` none | full | selective; under selective, ``option`` "op" checkpoints every block op by op, an
    integer N fully checkpoints blocks 0, N, 2N, ...
    """
    if mode == "full":
        return "full"
    if mode == "selective":
        opt = parse_ac_option(option)
        if opt == "op":
            return "op"
        return "full" if layer_id % opt == 0 else "none"
    if mode == "none":
        return "none"
    raise ConfigError(f"activation_checkpoint.mode: {mode!r} must be none, full or selective")


@dataclass(frozen=True)
class BatchSplit:
    global_batch: int  # sequences per optimizer step
    accum_steps: int  # forward-backward passes per optimizer step on each data-parallel rank
    problem: str = ""  # why the split is impossible ("" when it is fine)
    local_batch: int = 1  # sequences per data-parallel rank per forward-backward pass


def virtual_dp_degree(training) -> int:
    """The virtual data-parallel degree V of a layout-invariant run (``training.layout_invariant``), 0 otherwise."""
    return training.virtual_dp_degree if training.layout_invariant else 0


def canonical_microbatch_size(cfg) -> int:
    """Sequences per canonical microbatch of a layout-invariant run (the tokens of one forward, the same under every
    layout): ``training.local_batch_size``, or under pipeline parallelism ``pipeline_parallel_microbatch_size`` (the
    schedule's microbatch). Keep it the same on the layouts you compare."""
    p = cfg.parallelism
    return p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else cfg.training.local_batch_size


def batch_split(global_batch_size: int, local_batch_size: int, dp: int, virtual_dp: int = 0) -> BatchSplit:
    """``training.global_batch_size`` over ``dp`` data-parallel ranks reading ``local_batch_size`` sequences per pass:
    the global batch, the number of accumulation steps and the local batch. ``local_batch_size = -1``: the global
    batch split evenly over the ranks, no accumulation (the global batch, hence the run, is the same under every
    layout); in a layout-invariant run (``virtual_dp`` V > 0) split over the V virtual ranks instead, one canonical
    microbatch each (the same tokens per forward under every layout), V / dp passes per rank.
    ``global_batch_size = -1``: ``local_batch_size x dp`` (torchtitan's meaning: it changes with dp), or
    ``local_batch_size x V`` in a layout-invariant run."""
    if global_batch_size == -1 and local_batch_size == -1:
        return BatchSplit(
            1,
            1,
            "training.global_batch_size and training.local_batch_size are both -1 (each derived from the other); "
            "set training.global_batch_size, the sequences per optimizer step",
        )
    if local_batch_size < 1 and local_batch_size != -1:
        return BatchSplit(1, 1, f"training.local_batch_size: {local_batch_size} must be -1 (derived) or >= 1")
    if local_batch_size == -1:
        gbs = global_batch_size
        if gbs < 1:
            return BatchSplit(1, 1, f"training.global_batch_size: {gbs} must be -1 or >= 1")
        if gbs % dp:
            return BatchSplit(
                gbs,
                1,
                f"training.global_batch_size {gbs} does not split over the data-parallel degree {dp} (local batch "
                f"= global / dp); set training.global_batch_size to a multiple of {dp}, or training.local_batch_size "
                f"for a batch per rank",
            )
        if not virtual_dp:
            return BatchSplit(gbs, 1, local_batch=gbs // dp)
        if gbs % virtual_dp:
            return BatchSplit(
                gbs,
                1,
                f"training.global_batch_size {gbs} does not split over training.virtual_dp_degree {virtual_dp} (one "
                f"canonical microbatch per virtual rank); set training.global_batch_size to a multiple of "
                f"{virtual_dp}, or training.local_batch_size for the canonical microbatch",
            )
        local_batch_size = gbs // virtual_dp
    gbs = global_batch_size if global_batch_size != -1 else local_batch_size * (virtual_dp or dp)
    if gbs < 1:
        return BatchSplit(max(gbs, 1), 1, f"training.global_batch_size: {gbs} must be -1 or >= 1")
    per_pass = local_batch_size * dp
    if gbs % per_pass:
        return BatchSplit(
            gbs,
            max(1, gbs // per_pass),
            f"training.global_batch_size {gbs} is not divisible by local_batch_size {local_batch_size} "
            f"x data-parallel degree {dp}; use a multiple of {per_pass} (or training.local_batch_size -1: the "
            f"global batch split over the ranks)",
            local_batch_size,
        )
    return BatchSplit(gbs, gbs // per_pass, local_batch=local_batch_size)
