"""Sampling from a model: a titanlike checkpoint of any layout or a Hugging Face folder, in one process or under
``torchrun`` with tensor parallelism (the model's own sharding entries).

* :func:`load_model`: the model of a checkpoint (a ``step-N`` folder, a checkpoint folder: its newest committed
  step, or a Hugging Face folder with config.json), built on the meta device, tensor-parallel over ``tp_mesh`` if
  given, each rank loading only its shards (DCP; a Hugging Face folder is read whole and distributed);
* :func:`generate`: token ids in, new token ids out, for a batch of prompts of different lengths (left padding
  with each row's own positions and a key mask); greedy or sampled (temperature, top-k, top-p, a seed); stops a
  row at EOS. A key/value cache per attention seam (``titanlike.models.kv_cache``); a model whose attention cannot
  cache says so (:func:`cache_blockers`) and runs without one, one prompt at a time, recomputing the sequence.

``scripts/generate.py`` is the command line; docs/evaluation.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from titanlike.errors import ConfigError
from titanlike.models.kv_cache import DecodeState, cache_blockers, kv_cached

__all__ = ["Loaded", "Sampling", "cache_blockers", "generate", "load_model", "resolve_source", "sample_next"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: ``temperature`` 0 is greedy (argmax); else softmax(logits / temperature) over
    the ``top_k`` most likely tokens (0: all) and the smallest set of them holding ``top_p`` of the mass (1: all),
    drawn from a generator seeded with ``seed`` (the same tokens on every run and every tensor-parallel rank)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def problems(self) -> list[str]:
        out = []
        if self.temperature < 0:
            out.append(f"temperature {self.temperature} is negative; use 0 (greedy) or a positive value")
        if self.top_k < 0:
            out.append(f"top_k {self.top_k} is negative; use 0 (all tokens) or a positive count")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p {self.top_p} is not in (0, 1]")
        return out


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of ``logits`` (batch, vocab), as ``sampling`` says."""
    logits = logits.float()
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > sampling.top_p  # the mass before a token already holds top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1).cpu()  # drawn on the host: the same draw on every device
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


def _check_request(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling) -> None:
    problems = list(sampling.problems())
    if not prompts or any(len(p) == 0 for p in prompts):
        problems.append("every prompt needs at least one token")
    if max_new_tokens < 1:
        problems.append(f"max_new_tokens {max_new_tokens} must be at least 1")
    limit = getattr(getattr(model, "args", None), "max_seq_len", None)
    longest = max((len(p) for p in prompts), default=0)
    if limit is not None and longest + max_new_tokens > limit:
        problems.append(
            f"the longest prompt ({longest} tokens) + max_new_tokens {max_new_tokens} exceeds the model's "
            f"max_seq_len {limit}; shorten the prompt or ask for fewer tokens"
        )
    if problems:
        raise ConfigError("generate: " + "; ".join(problems))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    vocab_size: int | None = None,
    use_cache: bool = True,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt (token ids), at most ``max_new_tokens``, a row ending at its first
    ``eos_id`` (kept, as transformers' ``generate`` does) or once ``stop(its new tokens)`` is true (a stop string
    decoded, say). ``vocab_size``: only ids below it are chosen (a padded vocabulary's extra rows never are).
    ``use_cache=False``, or a model with :func:`cache_blockers`: every step recomputes the sequence, one prompt at
    a time. Every tensor-parallel rank must call it with the same input."""
    _check_request(model, prompts, max_new_tokens, sampling)
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
    try:
        if use_cache and not cache_blockers(model):
            return _generate_cached(model, prompts, max_new_tokens, sampling, gen, _Ends(eos_id, stop), vocab_size)
        rows = []
        for p in prompts:
            rows += _generate_uncached(model, p, max_new_tokens, sampling, gen, _Ends(eos_id, stop), vocab_size)
        return rows
    finally:
        model.train(was_training)


def _logits(out) -> torch.Tensor:
    out = getattr(out, "full_tensor", lambda: out)()  # a DTensor head output (never under load_model's plan)
    return out[:, -1]


@dataclass(frozen=True)
class _Ends:
    """When a row is complete: its last token is ``eos_id``, or ``stop(row)``."""

    eos_id: int | None
    stop: Callable[[list[int]], bool] | None

    def __call__(self, row: list[int]) -> bool:
        return (self.eos_id is not None and row[-1] == self.eos_id) or (self.stop is not None and self.stop(row))


def _generate_cached(model, prompts, max_new_tokens, sampling, gen, ends: _Ends, vocab_size):
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    tokens = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=device)
    state = DecodeState(pad)
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    with kv_cached(model, state):
        for _ in range(max_new_tokens):
            state.begin(tokens.shape[1])
            logits = _logits(model(tokens))
            state.end(tokens.shape[1])
            nxt = sample_next(logits[:, :vocab_size] if vocab_size else logits, sampling, gen)
            for b in (~done).nonzero().flatten().tolist():
                out[b].append(int(nxt[b]))
                done[b] = ends(out[b])
            if bool(done.all()):
                break
            tokens = nxt[:, None]
    return out


def _generate_uncached(model, prompt, max_new_tokens, sampling, gen, ends: _Ends, vocab_size):
    seq = torch.tensor([list(prompt)], device=next(model.parameters()).device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = _logits(model(seq))
        nxt = sample_next(logits[:, :vocab_size] if vocab_size else logits, sampling, gen)
        new.append(int(nxt[0]))
        if ends(new):
            break
        seq = torch.cat((seq, nxt[:, None]), dim=1)
    return [new]


# ------------------------------------------------------------------------------------------------ loading
@dataclass
class Loaded:
    """A loaded model and what its checkpoint says: ``kind`` "dcp" or "hf", ``path`` the step folder or the
    Hugging Face folder, ``meta`` the checkpoint.json ({} for a Hugging Face folder)."""

    model: nn.Module
    args: object
    kind: str
    path: Path
    meta: dict


def resolve_source(path: str | os.PathLike) -> tuple[str, Path]:
    """("dcp", step folder) for a titanlike checkpoint step folder, or a checkpoint folder (its newest committed
    step); ("hf", folder) for a Hugging Face folder (config.json + safetensors). ConfigError otherwise."""
    from titanlike.checkpoint import committed_checkpoints
    from titanlike.hf import CONFIG_NAME

    p = Path(path)
    if (p / ".metadata").is_file():
        return "dcp", p
    steps = committed_checkpoints(p)
    if steps:
        return "dcp", steps[max(steps)]
    if (p / CONFIG_NAME).is_file():
        return "hf", p
    raise ConfigError(
        f"'{path}' is neither a titanlike checkpoint (a step-N folder, or a folder of them) nor a Hugging Face "
        f"folder (config.json + model.safetensors); pass one of those"
    )


def load_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp_mesh=None,
) -> Loaded:
    """The model of ``path`` (:func:`resolve_source`) on ``device`` in ``dtype``, in eval mode; tensor-parallel
    over the 1-D ``tp_mesh`` (the model's own sharding entries, no sequence parallelism, logits gathered) when
    given. Collective under ``tp_mesh``: every rank calls it."""
    from titanlike.checkpoint import load_parts, model_args_of, read_meta
    from titanlike.hf import hf_architecture, load_hf
    from titanlike.models import spec_for

    kind, source = resolve_source(path)
    try:
        args = hf_architecture(source) if kind == "hf" else model_args_of(source)
    except ValueError as e:
        raise ConfigError(f"'{path}': {e}") from None
    spec = spec_for(args)
    model = spec.build_meta(args).to(dtype=dtype)
    if tp_mesh is not None:
        _apply_generation_tp(model, spec, tp_mesh)
    model.to_empty(device=device)
    model.init_buffers(torch.device(device))
    if kind == "dcp":
        load_parts(source, [model])
    else:
        state_dict, _ = load_hf(source, args, dtype=dtype)
        _load_full_state_dict(model, state_dict)
    return Loaded(model.eval(), args, kind, source, read_meta(source) if kind == "dcp" else {})


def _apply_generation_tp(model: nn.Module, spec, tp_mesh) -> None:
    from titanlike.parallel.tensor_parallel import apply_tp

    try:
        apply_tp(model, tp_mesh, sequence_parallel=False, loss_parallel=False)
    except ValueError as e:
        raise ConfigError(
            f"generation under tensor parallelism: model '{spec.name}' cannot split without sequence parallelism, "
            f"which a one-token decode step cannot shard ({e}); run it in one process"
        ) from None


def _load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Full tensors into ``model`` (plain, or sharded: each rank keeps its shards of them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        model.load_state_dict(state_dict, strict=True)
        return
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
