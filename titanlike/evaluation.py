"""lm-evaluation-harness for titanlike models: the ``titanlike`` LM (``lm_eval --model titanlike``), tasks from local
files only, and :func:`evaluate` (what ``scripts/eval.py`` and the trainer's ``[eval]`` section run).

:class:`TitanlikeLM` is lm-eval's ``TemplateLM`` (its tokenisation of context / continuation pairs, its empty-context
rule, its rolling windows: the same code lm-eval's ``hf`` model runs) over any titanlike model: loaded from a
checkpoint of any layout or a Hugging Face folder (``--model_args checkpoint=<path>,tokenizer=<name or folder>``), or
a model already built (the trainer's, sharded under its layout: every rank runs every request, the logits of a
tensor-parallel head gathered, nothing of the model gathered). ``loglikelihood`` and ``loglikelihood_rolling`` score
right-padded batches (a causal model's logits of a position do not see what follows it); ``generate_until`` runs
``titanlike.generate`` (KV cache, batched) and cuts the text at the first stop string.

Tasks: lm-eval task YAMLs whose ``dataset_kwargs.data_files`` are local files (never a hub download): a folder of
them is given to lm-eval's ``TaskManager(include_path=...)``. The shipped ``shakespeare_next_line`` task
(``titanlike/assets/tasks``): which of four lines follows a passage of the shipped corpus (docs/evaluation.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from titanlike.errors import ConfigError
from titanlike.generate import Sampling, generate, load_model

__all__ = ["TASKS_DIR", "TitanlikeLM", "evaluate", "local_tasks", "task_manager", "task_metrics"]

TASKS_DIR = Path(__file__).resolve().parent / "assets" / "tasks"


@register_model("titanlike")
class TitanlikeLM(TemplateLM):
    """lm-eval's view of a titanlike model. ``checkpoint``: a step folder, a checkpoint folder (its newest step) or
    a Hugging Face folder; or ``model`` (a built module, e.g. the trainer's) with ``tokenizer`` (a titanlike
    tokenizer object, or a name / folder for ``build_tokenizer``; default: the one the checkpoint recorded, or the
    Hugging Face folder's). ``max_length``: the longest window scored (default the model's ``max_seq_len``);
    ``pad_multiple``: batches are right-padded to a multiple of it (sequence / context parallel layouts);
    ``add_bos_token``: start every text with BOS (default: as the tokenizer does by itself, lm-eval's ``hf`` rule:
    a Hugging Face tokenizer.json whose post-processor adds BOS does, titanlike's tiktoken tokenizers do not)."""

    def __init__(
        self,
        checkpoint: str | None = None,
        tokenizer=None,
        *,
        model: nn.Module | None = None,
        dtype: str = "float32",
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        pad_multiple: int = 1,
        add_bos_token: bool | None = None,
        device: str | None = None,
        **unused,
    ):
        super().__init__()
        _check_unused(unused)
        if (model is None) == (checkpoint is None):
            raise ConfigError("titanlike LM: give checkpoint=<path> (or, from Python, model=<module>), not both")
        meta, folder = {}, None
        if model is None:
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            loaded = load_model(checkpoint, dtype=getattr(torch, dtype), device=device)
            model, meta = loaded.model, loaded.meta
            folder = loaded.path if loaded.kind == "hf" else None
        self.model = model
        self.tokenizer = _tokenizer(tokenizer, meta, folder)
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise ConfigError(f"titanlike LM: batch_size {batch_size!r}: give a positive number (no 'auto' search)")
        self.batch_size = int(batch_size)
        limit = getattr(getattr(model, "args", None), "max_seq_len", None)
        self.max_length = int(max_length or limit or 2048)
        self.max_gen_toks = int(max_gen_toks)
        self.pad_multiple = max(int(pad_multiple), 1)
        self.add_bos = _adds_bos(self.tokenizer) if add_bos_token is None else _bool(add_bos_token)

    # ------------------------------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The context of an empty context: BOS, else EOS (lm-eval's ``hf`` rule)."""
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """lm-eval's ``hf`` rule: BOS unless told not to (``add_special_tokens=False``), the model does not take
        one, or the text starts with it already."""
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and bos and string.startswith(self.tok_decode([self.prefix_token_id])):
            bos = False
        return self.tokenizer.encode(string, bos=bool(bos) and self.tokenizer.bos_id is not None)

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # ------------------------------------------------------------------------------------------ scoring
    @torch.no_grad()
    def _logprobs(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Log-softmax over the vocabulary (float32) of every position of each row, one right-padded forward."""
        longest = max(len(r) for r in rows)
        width = -(-longest // self.pad_multiple) * self.pad_multiple
        device = next(self.model.parameters()).device
        x = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model(x)
        finally:
            self.model.train(was_training)
        out = getattr(out, "full_tensor", lambda: out)()  # a vocab-parallel head: the logits of every rank
        logp = F.log_softmax(out.float(), dim=-1)
        return [logp[i, : len(r)] for i, r in enumerate(rows)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None, **kwargs):
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request
        ``(key, context ids, continuation ids)``, batched by length (longest first)."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bs = int(override_bs or self.batch_size)
        for start in range(0, len(order), bs):
            chunk = order[start : start + bs]
            rows, conts = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                rows.append((context + continuation)[-(self.max_length + 1) :][:-1])
                conts.append(continuation)
            for i, row, cont, logp in zip(chunk, rows, conts, self._logprobs(rows)):
                tail = logp[len(row) - len(cont) :]  # the positions predicting the continuation
                target = torch.tensor(cont, device=tail.device)
                score = tail.gather(-1, target[:, None]).sum()
                results[i] = (float(score), bool((tail.argmax(-1) == target).all()))
                self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole string, in disjoint windows of ``max_length`` (lm-eval's rolling
        windows, each conditioned on the prefix token or the tokens before it)."""
        windows, counts = [], []
        for (string,) in (r.args for r in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            mine = [(None, *make_disjoint_window(w)) for w in rolling]
            windows += mine
            counts.append(len(mine))
        scores = self._loglikelihood_tokens(windows)
        out, at = [], 0
        for (string,), n in zip((r.args for r in requests), counts):
            out.append(sum(s for s, _ in scores[at : at + n]))
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), out[-1])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or ``do_sample`` / ``temperature``) continuations, cut at the first of ``until`` (and EOS)."""
        eos = self.tok_decode([self.eot_token_id])
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            new = int(kwargs.pop("max_gen_toks"))
            sampling = _sampling(kwargs)
            keep = max(self.max_length - new, 1)

            def stopped(row: list[int]) -> bool:
                text = self.tok_decode(row)
                return any(u in text for u in until)

            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0])[-keep:] for i in chunk]
                rows = generate(self.model, prompts, new, sampling=sampling, eos_id=self.eot_token_id, stop=stopped)
                for i, row in zip(chunk, rows):
                    text = self.tok_decode([t for t in row if t != self.eot_token_id])
                    for u in until:
                        text = text.split(u)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


def _sampling(kwargs: dict) -> Sampling:
    """A task's generation_kwargs (lm-eval-normalized, ``until`` and ``max_gen_toks`` taken) as a Sampling; a key
    titanlike does not honour is refused, never ignored."""
    unknown = sorted(set(kwargs) - {"do_sample", "temperature", "top_k", "top_p", "seed"})
    if unknown:
        raise ConfigError(f"titanlike LM: generation_kwargs {unknown} are not supported (do_sample, temperature, "
                          f"top_k, top_p, seed are)")  # fmt: skip
    if not kwargs.get("do_sample"):
        return Sampling()
    out = Sampling(
        temperature=float(kwargs.get("temperature") or 1.0),
        top_k=int(kwargs.get("top_k") or 0),
        top_p=float(kwargs.get("top_p") or 1.0),
        seed=int(kwargs.get("seed") or 0),
    )
    if out.problems():
        raise ConfigError("titanlike LM: generation_kwargs: " + "; ".join(out.problems()))
    return out


def _bool(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def _adds_bos(tokenizer) -> bool:
    """Whether the tokenizer by itself starts a text with BOS (a Hugging Face tokenizer.json's post-processor)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or tokenizer.bos_id is None:
        return False
    return backend.encode("a", add_special_tokens=True).ids[:1] == [tokenizer.bos_id]


def _check_unused(unused: dict) -> None:
    """lm-eval passes ``max_batch_size`` (and None values) to every model; anything else is a typo."""
    unknown = sorted(k for k, v in unused.items() if k not in ("max_batch_size",) and v is not None)
    if unknown:
        raise ConfigError(
            f"titanlike LM: unknown model_args {unknown}; use checkpoint, tokenizer, dtype, batch_size, max_length, "
            f"max_gen_toks, add_bos_token, device"
        )


def _tokenizer(tokenizer, meta: dict, folder: Path | None):
    from titanlike.checkpoint import recorded_tokenizer
    from titanlike.data import build_tokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer  # a tokenizer object (the trainer's)
    name = tokenizer or recorded_tokenizer(meta)
    if name is None and folder is not None and (folder / "tokenizer.json").is_file():
        name = str(folder)
    if name is None:
        raise ConfigError("titanlike LM: the checkpoint records no tokenizer; pass tokenizer=<name or folder>")
    try:
        return build_tokenizer(str(name))
    except ValueError as e:
        raise ConfigError(f"titanlike LM: tokenizer: {e}") from None


def task_manager(include: Sequence[str | os.PathLike] = ()):
    """lm-eval's task index over the shipped task folder and ``include`` (folders of task YAMLs) only: lm-eval's
    own task folder is not read (its tasks download their data; indexing it costs tens of seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS_DIR), *map(str, include)], include_defaults=False)


def local_tasks(include: Sequence[str | os.PathLike] = ()) -> list[str]:
    """The task names defined by the YAMLs of the shipped folder and of ``include``."""
    return sorted(task_manager(include).all_tasks)


def evaluate(
    lm,
    tasks: Sequence[str],
    *,
    include: Sequence[str] = (),
    limit: int | None = None,
    seed: int = 0,
    log_samples: bool = False,
):
    """lm-eval's results dict for ``tasks`` on ``lm`` (any lm-eval LM), the tasks found in the shipped folder and
    ``include``. Unknown task names are refused in one line naming the local ones. Datasets are read offline
    (``HF_DATASETS_OFFLINE``): a task that would download is an error, never a download."""
    from lm_eval import simple_evaluate

    _offline()
    manager = task_manager(include)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        local = local_tasks(include)
        raise ConfigError(f"eval: unknown task(s) {unknown}; local tasks here: {', '.join(local) or 'none'}")
    with _rank_zero_view(), _own_rng():
        return simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            log_samples=log_samples,
            bootstrap_iters=0,
        )


@contextlib.contextmanager
def _rank_zero_view():
    """lm-eval's simple_evaluate returns the results only where LOCAL_RANK is 0 (it assumes its own data-parallel
    split); a titanlike LM runs every request on every rank (the layout's collectives need them all), so every rank
    gets the results."""
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK")
        else:
            os.environ["LOCAL_RANK"] = before


@contextlib.contextmanager
def _own_rng():
    """lm-eval seeds python's, numpy's and torch's generators: a run evaluating mid-training gets its own back."""
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def _offline() -> None:
    """datasets (and the hub client under it) never reach the network: it reads these at import and at load."""
    import datasets.config

    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    datasets.config.HF_DATASETS_OFFLINE = datasets.config.HF_HUB_OFFLINE = True


def task_metrics(results: dict) -> dict[str, float]:
    """``eval/<task>/<metric>`` -> value of every numeric metric of an lm-eval results dict (no stderr entries)."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            name = key.split(",")[0]
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and "stderr" not in name and name != "sample_len":
                out[f"eval/{task}/{name}"] = float(value)
    return out
