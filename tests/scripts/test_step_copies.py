"""scripts/step_copies.py: one step's allocations and copies from torch.profiler. With SDPA's enable_gqa (the
attention seam's path) the step runs no repeat_interleave and allocates less than with k and v repeated to every
query head (--gqa repeat, the former path, side by side); the patch is undone after the comparison."""

from __future__ import annotations

import step_copies  # noqa: E402

from titanlike.models.decoder import AttentionCore

TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2"]


def _allocated(events) -> int:
    return sum(max(e.self_cpu_memory_usage, 0) for e in events)


def test_grouped_heads_copy_nothing_and_allocate_less(capsys):
    forward = AttentionCore.forward
    _, args, now = step_copies.profile_step(TINY)
    _, _, repeat = step_copies.profile_step(TINY, "repeat")
    assert AttentionCore.forward is forward  # the comparison's patch undone
    assert args.n_heads > args.n_kv_heads
    keys = {e.key for e in now}
    assert "aten::repeat_interleave" not in keys and "aten::repeat_interleave" in {e.key for e in repeat}
    assert _allocated(now) < _allocated(repeat)
    assert step_copies.main([*TINY, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "attention enable_gqa" in out and "top 3 allocating operators" in out and "copies" in out
