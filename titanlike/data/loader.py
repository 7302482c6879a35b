"""Data-parallel loaders whose position is a single, layout-free integer.

Global step b (counted from the loader's start position s) consumes the global samples
[s + b*G, s + (b+1)*G), G = global_batch_size. Data-parallel rank r of D owns the contiguous slice
[s + b*G + r*G/D, s + b*G + (r+1)*G/D) and yields it as G/(D*L) consecutive micro-batches of L =
local_batch_size samples (gradient accumulation). Together with `PackedWindows`, which maps a
global sample index to a window independently of D, the union of all ranks' micro-batches of a
step is exactly the step's batch of a single-rank run, in order.

The position is the global index of the first sample of the next step, so a checkpoint taken
under one (dp_degree, local_batch_size, num_workers) resumes under any other. It advances when a
rank has been handed the last micro-batch of a step: mid-step it still names the start of that
step, and a resume from there replays the whole step, which is what a trainer whose checkpoint
holds no partially accumulated gradients needs.

Context parallelism: the cp ranks of one data-parallel rank read the same samples, and each keeps only its two
load-balanced chunks of every sequence (``cp_rank``, ``cp_degree``; see
``titanlike.parallel.context_parallel.cp_shard``), inputs and labels alike. The position is unchanged by cp.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlike.data.datasets import PackedWindows
from titanlike.data.mixture import BlendedWindows

Batch = tuple[torch.Tensor, ...]  # (inputs, labels) or, with document masking, (inputs, labels, document_starts)


def _check_layout(global_batch_size: int, local_batch_size: int, dp_rank: int, dp_degree: int) -> None:
    if dp_degree < 1:
        raise ValueError(f"dp_degree must be >= 1, got {dp_degree}")
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}")
    if local_batch_size < 1 or global_batch_size < 1:
        raise ValueError(f"batch sizes must be >= 1, got global {global_batch_size}, local {local_batch_size}")
    if global_batch_size % (dp_degree * local_batch_size):
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by dp_degree {dp_degree} x "
            f"local_batch_size {local_batch_size}; use a multiple of {dp_degree * local_batch_size}"
        )


class _CPSlice:
    """(inputs, labels) -> this cp rank's two load-balanced chunks of each (identity at cp 1); picklable.

    With ``eos_id`` (document masking, ``model.attn_mask_type = "block_causal"``) the batch gains a third tensor, the
    document start of every token (``titanlike.models.masking.document_starts``), derived here, from the whole
    window, before the cut, and cut like the inputs: the one place document boundaries are read."""

    def __init__(self, cp_rank: int = 0, cp_degree: int = 1, seq_len: int | None = None, eos_id: int | None = None):
        if cp_degree < 1 or not 0 <= cp_rank < cp_degree:
            raise ValueError(f"cp_rank must be in [0, cp_degree), got {cp_rank} of {cp_degree}")
        if seq_len is not None and cp_degree > 1 and seq_len % (2 * cp_degree):
            raise ValueError(f"seq_len {seq_len} is not divisible by 2 x cp_degree = {2 * cp_degree}")
        self.cp_rank, self.cp_degree, self.eos_id = cp_rank, cp_degree, eos_id

    def __call__(self, batch: Batch) -> Batch:
        if self.eos_id is not None:
            from titanlike.models.masking import document_starts

            batch = (*batch, document_starts(batch[0], self.eos_id))
        if self.cp_degree == 1:
            return batch
        from titanlike.parallel.context_parallel import cp_shard

        return tuple(cp_shard(t, self.cp_degree, self.cp_rank, dim=1) for t in batch)


def _check_position(global_sample: Any) -> int:
    if isinstance(global_sample, bool) or not isinstance(global_sample, (int, np.integer)) or global_sample < 0:
        raise ValueError(
            f"the data loader position must be a non-negative integer global sample index, got {global_sample!r}"
        )
    return int(global_sample)


class GlobalSampleStream(IterableDataset):
    """The endless micro-batches of one data-parallel rank, starting at a global sample position.

    Stateful (``state_dict() -> {"global_sample": int}``). Only the instance in the main process
    carries the position: `TokenDataLoader` advances it as micro-batches are handed out, since
    copies in worker processes cannot report back. In a DataLoader with N workers, worker w
    produces micro-batches w, w + N, ... of the rank's sequence, which the loader's in-order
    round robin puts back in sequence.
    """

    def __init__(
        self,
        windows: PackedWindows | BlendedWindows,
        *,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        start_sample: int = 0,
        cp_rank: int = 0,
        cp_degree: int = 1,
        eos_id: int | None = None,
    ):
        _check_layout(global_batch_size, local_batch_size, dp_rank, dp_degree)
        self.cp_rank, self.cp_degree = cp_rank, cp_degree
        self._cp = _CPSlice(cp_rank, cp_degree, windows.seq_len, eos_id)
        self.windows = windows
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.accumulation_steps = global_batch_size // (dp_degree * local_batch_size)
        self.global_sample = _check_position(start_sample)  # first sample of the next unfinished step
        self.micro_batch = 0  # micro-batches of that step already handed out (resumed only by a fresh iterator)

    def micro_batch_samples(self, step_start: int, micro_batch: int) -> range:
        """The global samples of this rank's `micro_batch` in the step that starts at `step_start`."""
        first = (
            step_start + self.dp_rank * (self.global_batch_size // self.dp_degree) + micro_batch * self.local_batch_size
        )
        return range(first, first + self.local_batch_size)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        step_start, micro_batch = self.global_sample, self.micro_batch
        for k in range(worker, 1 << 62, n_workers):
            m = micro_batch + k
            yield self._cp(
                self.windows.batch(
                    self.micro_batch_samples(
                        step_start + (m // self.accumulation_steps) * self.global_batch_size,
                        m % self.accumulation_steps,
                    )
                )
            )

    def advance(self) -> None:
        """Record that one more micro-batch was handed to the trainer."""
        self.micro_batch += 1
        if self.micro_batch == self.accumulation_steps:
            self.micro_batch = 0
            self.global_sample += self.global_batch_size

    def state_dict(self) -> dict[str, int]:
        return {"global_sample": self.global_sample}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or "global_sample" not in state_dict:
            raise ValueError(f"a data loader state must be {{'global_sample': int}}, got {state_dict!r}")
        self.global_sample = _check_position(state_dict["global_sample"])
        self.micro_batch = 0


class TokenDataLoader(StatefulDataLoader):
    """A StatefulDataLoader over a `GlobalSampleStream` whose state is ``{"global_sample": int}``.

    The state is kept in the main process and counts micro-batches as they are handed out, so it
    is exact with any number of workers and independent of how many batches they prefetched.
    Each ``iter()`` starts where the previous iterator's consumer stopped; use one at a time.
    """

    dataset: GlobalSampleStream

    def __iter__(self) -> Iterator[Batch]:
        for batch in super().__iter__():
            self.dataset.advance()
            yield batch

    def state_dict(self) -> dict[str, int]:
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state_dict)


def loader_position(loader: TokenDataLoader) -> int:
    """The global index of the first sample of the first step not yet fully handed out (checkpoint this)."""
    return loader.state_dict()["global_sample"]


def set_loader_position(loader: TokenDataLoader, global_sample: int) -> None:
    """Make the next ``iter(loader)`` start the step whose first global sample is `global_sample`."""
    loader.load_state_dict({"global_sample": global_sample})


def build_dataloader(
    tokens,
    *,
    seq_len: int,
    global_batch_size: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int,
    shuffle: bool = True,
    num_workers: int = 0,
    start_sample: int = 0,
    pin_memory: bool = False,
    cp_rank: int = 0,
    cp_degree: int = 1,
    eos_id: int | None = None,
) -> TokenDataLoader:
    """An endless loader of (inputs, labels), each LongTensor[local_batch_size, seq_len], for one rank; with
    ``eos_id`` (document masking) of (inputs, labels, document_starts).

    ``tokens``: a token array or `TokenShards` (cut into `PackedWindows` with ``seed`` / ``shuffle``), or the global
    sample stream itself (`PackedWindows`, or `BlendedWindows` for a weighted mixture: ``Corpus.windows``).
    Every global_batch_size / (dp_degree * local_batch_size) consecutive batches make one
    optimizer step. `start_sample` (or `set_loader_position`) resumes from a checkpointed position.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if isinstance(tokens, (PackedWindows, BlendedWindows)):
        if tokens.seq_len != seq_len:
            raise ValueError(f"the sample stream has seq_len {tokens.seq_len}, the loader was asked for {seq_len}")
        windows = tokens
    else:
        windows = PackedWindows(tokens, seq_len, seed=seed, shuffle=shuffle)
    stream = GlobalSampleStream(
        windows,
        global_batch_size=global_batch_size,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        start_sample=start_sample,
        cp_rank=cp_rank,
        cp_degree=cp_degree,
        eos_id=eos_id,
    )
    with warnings.catch_warnings():  # torchdata <= 0.11 calls torch.set_vital, deprecated in recent torch
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        # A generator of its own: every iter() draws the workers' base seed from it, and from the global one
        # otherwise, which would put the global RNG one draw off after a resume (the model's dropout, say, would
        # then not continue bitwise). The batches never depend on it (the order is a function of the seed).
        return TokenDataLoader(
            stream,
            batch_size=None,
            num_workers=num_workers,
            pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(seed),
        )


class _ValidationBatches(torch.utils.data.Dataset):
    def __init__(
        self,
        windows: PackedWindows,
        batch_size: int,
        dp_rank: int,
        dp_degree: int,
        n_batches: int,
        cp: _CPSlice | None = None,
    ):
        self.windows, self.batch_size, self.dp_rank, self.dp_degree = windows, batch_size, dp_rank, dp_degree
        self.cp = cp or _CPSlice()
        self.n_batches = n_batches

    def __len__(self) -> int:
        return self.n_batches

    def __getitem__(self, k: int) -> Batch:
        if not 0 <= k < self.n_batches:
            raise IndexError(f"validation batch {k} out of range [0, {self.n_batches})")
        first = (k * self.dp_degree + self.dp_rank) * self.batch_size
        return self.cp(self.windows.batch(range(first, first + self.batch_size)))


def build_validation_loader(
    tokens,
    *,
    seq_len: int,
    batch_size: int,
    dp_rank: int,
    dp_degree: int,
    max_batches: int | None = None,
    cp_rank: int = 0,
    cp_degree: int = 1,
    eos_id: int | None = None,
) -> DataLoader:
    """A finite, deterministic loader of (inputs, labels) batches over `tokens`, in storage order (with ``eos_id``:
    (inputs, labels, document_starts), as :func:`build_dataloader`).

    Batch k of rank r is windows [(k*D + r)*B, (k*D + r + 1)*B): ranks read disjoint windows, every
    rank gets the same number of batches (so collectives over them match up), the trailing windows
    that cannot fill a batch on every rank are dropped, and the first K batches of all ranks
    together cover the same windows under any dp_degree D. Iterating again replays the same batches.
    """
    _check_layout(batch_size * dp_degree, batch_size, dp_rank, dp_degree)
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
    n_windows = max(len(tokens) - 1, 0) // max(seq_len, 1)
    n_batches = n_windows // (batch_size * dp_degree)
    if n_batches == 0:
        raise ValueError(
            f"the validation split has {len(tokens)} tokens, {n_windows} windows of {seq_len + 1}: "
            f"too few for one batch of {batch_size} on each of {dp_degree} ranks; raise val_fraction "
            f"or lower the batch size"
        )
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    windows = PackedWindows(tokens, seq_len, shuffle=False)
    cp = _CPSlice(cp_rank, cp_degree, seq_len, eos_id)
    return DataLoader(
        _ValidationBatches(windows, batch_size, dp_rank, dp_degree, n_batches, cp),
        batch_size=None,
        generator=torch.Generator().manual_seed(0),
    )  # leaves the global RNG alone
