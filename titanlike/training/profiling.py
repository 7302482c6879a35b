"""Step-windowed ``torch.profiler`` traces and CUDA memory snapshots, off by default and free when off.

Use (the trainer)::

    with maybe_profile(cfg, rank, cfg.job.dump_folder, global_step=start_step) as prof:
        for step in ...:
            train_step(...)
            prof.step()

With ``profiling.enable_profiling`` on this rank (``profiling.ranks``; an empty list means every rank), the
profiler records ``profile_active`` steps after ``profile_warmup`` warm-up steps at the end of every
``profile_freq`` steps and writes a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing)::

    <dump_folder>/<save_traces_folder>/iteration_<step>/rank<rank>_trace.json

``step`` counts training steps from ``global_step``, so a resumed run profiles the same steps as an
uninterrupted one. With ``profiling.enable_memory_snapshot`` on CUDA, the allocator's history is recorded and
dumped every ``profile_freq`` steps, and once more if the block exits with an exception (an OOM's snapshot is
the useful one)::

    <dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/rank<rank>_memory_snapshot.pickle
    <dump_folder>/<save_memory_snapshot_folder>/iteration_<step>_exit/rank<rank>_memory_snapshot.pickle

(open them at https://pytorch.org/memory_viz). Without CUDA there is no snapshot. Disabled, ``maybe_profile``
returns a shared object whose ``step()`` does nothing.
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["maybe_profile", "Profiler", "NO_PROFILER"]

logger = logging.getLogger(__name__)

_SNAPSHOT_MAX_ENTRIES = 100_000


class _NoProfiler:
    """Profiling off: a context manager whose ``step()`` does nothing."""

    enabled = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self) -> None:
        return None


NO_PROFILER = _NoProfiler()


class Profiler:
    """Traces and/or memory snapshots for a window of steps on one rank (see the module docstring)."""

    enabled = True

    def __init__(self, pcfg, rank: int, dump_folder: str, global_step: int = 0):
        wait = pcfg.profile_freq - pcfg.profile_warmup - pcfg.profile_active
        if pcfg.enable_profiling and wait < 0:
            raise ValueError(
                f"profiling.profile_freq ({pcfg.profile_freq}) must be at least profile_warmup + "
                f"profile_active ({pcfg.profile_warmup} + {pcfg.profile_active})"
            )
        self.rank = rank
        self.freq = pcfg.profile_freq
        self.step_num = global_step
        self.trace_dir = os.path.join(dump_folder, pcfg.save_traces_folder) if pcfg.enable_profiling else None
        self.snapshot_dir = (
            os.path.join(dump_folder, pcfg.save_memory_snapshot_folder)
            if pcfg.enable_memory_snapshot and torch.cuda.is_available()
            else None
        )
        if pcfg.enable_memory_snapshot and self.snapshot_dir is None:
            logger.warning("profiling.enable_memory_snapshot needs CUDA; no memory snapshot will be written")
        self._torch_profiler = None
        if self.trace_dir is not None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch_profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=wait, warmup=pcfg.profile_warmup, active=pcfg.profile_active),
                on_trace_ready=self._write_trace,
                record_shapes=True,
            )

    def _write_trace(self, prof) -> None:
        folder = os.path.join(self.trace_dir, f"iteration_{self.step_num}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        prof.export_chrome_trace(path)
        logger.info("profiler trace written to %s", path)

    def _dump_snapshot(self, name: str) -> None:
        folder = os.path.join(self.snapshot_dir, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        logger.info("CUDA memory snapshot written to %s", path)

    def __enter__(self):
        if self.snapshot_dir is not None:
            torch.cuda.memory._record_memory_history(max_entries=_SNAPSHOT_MAX_ENTRIES)
        if self._torch_profiler is not None:
            # Align the profiler's own step counter, which its schedule reads, with the training step, so
            # that a resumed run profiles the same steps as an uninterrupted one.
            self._torch_profiler.step_num = self.step_num
            self._torch_profiler.current_action = self._torch_profiler.schedule(self.step_num)
            self._torch_profiler.__enter__()
        return self

    def step(self) -> None:
        """Call once after every training step."""
        self.step_num += 1
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        if self.snapshot_dir is not None and self.step_num % self.freq == 0:
            self._dump_snapshot(f"iteration_{self.step_num}")

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._torch_profiler is not None:
                self._torch_profiler.__exit__(exc_type, exc, tb)
        finally:
            if self.snapshot_dir is not None:
                if exc_type is not None:
                    self._dump_snapshot(f"iteration_{self.step_num}_exit")
                torch.cuda.memory._record_memory_history(enabled=None)


def maybe_profile(cfg, rank: int, dump_folder: str, global_step: int = 0) -> Profiler | _NoProfiler:
    """A context manager with ``.step()``: a :class:`Profiler` if profiling or memory snapshots are on for
    ``rank``, else :data:`NO_PROFILER`.

    ``cfg`` is the :class:`titanlike.config.JobConfig` or its ``profiling`` section.
    """
    pcfg = getattr(cfg, "profiling", cfg)
    if not (pcfg.enable_profiling or pcfg.enable_memory_snapshot):
        return NO_PROFILER
    if pcfg.ranks and rank not in pcfg.ranks:
        return NO_PROFILER
    return Profiler(pcfg, rank, dump_folder, global_step)
