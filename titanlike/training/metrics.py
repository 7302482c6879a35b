"""Rank-0 metrics: a console line, tensorboard scalars, ``<dump_folder>/metrics.jsonl`` and the trackers
(Weights & Biases: ``titanlike.training.trackers``), all fed the same values by :class:`MetricsLogger`."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch


def peak_host_bytes() -> int:
    """This process's peak resident set size so far (``ru_maxrss``, KiB on Linux: the VmHWM of /proc)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: the CUDA caching allocator's peak, or the host's max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_host_bytes() / 2**30


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


_COLORS = {
    "step": "\033[36m",
    "loss": "\033[32m",
    "val_loss": "\033[32m",
    "lr": "\033[33m",
    "grad_norm": "\033[35m",
    "tok/s": "\033[34m",
    "mfu": "\033[34m",
    "mem": "\033[33m",
    "eta": "\033[37m",
}
_RESET = "\033[0m"


def colorize(line: str) -> str:
    """The console line with each 'name value' pair colored (ANSI), as torchtitan's logger does on a terminal."""
    words = line.split()
    out = []
    i = 0
    while i < len(words):
        if words[i] in _COLORS and i + 1 < len(words):
            out.append(f"{_COLORS[words[i]]}{words[i]} {words[i + 1]}{_RESET}")
            i += 2
        else:
            out.append(words[i])
            i += 1
    return "  ".join(out)


def use_color(disabled: bool) -> bool:
    """Colors only on a terminal, and never with metrics.disable_color_printing (or NO_COLOR set)."""
    import os

    return not disabled and sys.stdout.isatty() and "NO_COLOR" not in os.environ


def _continue_or_rotate(path: Path, start_step: int) -> None:
    """Never append to another run's metrics silently: a fresh run (start_step 0) moves an existing metrics.jsonl
    aside to metrics.jsonl.N; a resumed run keeps the lines up to its step and drops later ones (a previous attempt
    that ran past the checkpoint it resumes from), saying so."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    if start_step == 0:
        n = 1
        while path.with_name(f"{path.name}.{n}").exists():
            n += 1
        path.rename(path.with_name(f"{path.name}.{n}"))
        print(f"metrics: {path} holds another run's metrics; moved it to {path.name}.{n}", flush=True)
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            step = json.loads(line).get("step", 0)
        except ValueError:
            continue
        if step <= start_step:
            keep.append(line)
    if len(keep) != len(lines):
        path.write_text("".join(keep))
        print(
            f"metrics: resuming at step {start_step}: dropped {len(lines) - len(keep)} line(s) of {path} logged "
            f"after it by the run that stopped",
            flush=True,
        )


def _short(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def data_metrics(seen: dict[str, tuple[int, float]]) -> dict[str, float]:
    """Per-source values for metrics.jsonl / tensorboard: ``data.<source>.tokens`` (trained on so far) and
    ``data.<source>.epochs`` (read so far, fractional), from ``Corpus.seen``."""
    out: dict[str, float] = {}
    for name, (tokens, epochs) in seen.items():
        out[f"data.{name}.tokens"] = tokens
        out[f"data.{name}.epochs"] = epochs
    return out


def format_data(seen: dict[str, tuple[int, float]]) -> str:
    """The console summary of a mixture: tokens and epochs of each source."""
    return "data  " + "  ".join(f"{name} {_short(tok)} tok {ep:.2f} ep" for name, (tok, ep) in seen.items())


class MetricsLogger:
    """Writes on rank 0 only; other ranks get a logger that does nothing."""

    def __init__(
        self,
        dump_folder: str | Path,
        *,
        enabled: bool,
        tensorboard: bool,
        tb_folder: str,
        jsonl: bool,
        color: bool = False,
        start_step: int = 0,
        trackers: tuple = (),
    ):
        self.enabled = enabled
        self.color = color
        self.writer = None
        self.jsonl = None
        self.trackers = tuple(trackers)  # objects with log(step, values) and close(): every value logged goes there
        if not enabled:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(folder / tb_folder))
        if jsonl:
            path = folder / "metrics.jsonl"
            _continue_or_rotate(path, start_step)
            self.jsonl = open(path, "a", buffering=1)

    def log(self, step: int, values: dict[str, float], *, console: str | None = None) -> None:
        if not self.enabled:
            return
        if console:
            print(colorize(console) if self.color else console, flush=True)
        if self.writer is not None:
            for k, v in values.items():
                if v is not None and isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
        if self.jsonl is not None:
            # repr-precision floats: json writes the shortest string that round-trips the float64 exactly.
            self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
        for tracker in self.trackers:
            tracker.log(step, values)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


class Throughput:
    """Tokens/s between log points (wall clock, after a device synchronize) and the ETA to the last step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def measure(self, steps_done_since: int, steps_left: int) -> tuple[float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed = max(now - self.last, 1e-9)
        tps = self.tokens / elapsed
        eta = elapsed / max(steps_done_since, 1) * steps_left
        self.last, self.tokens = now, 0
        return tps, eta


def expert_metrics(moe: dict) -> dict[str, float]:
    """The MoE numbers of a step (``StepResult.moe``) as metrics: the auxiliary loss (summed over the layers; the
    logged ``loss`` stays the cross entropy), the worst layer's max / mean tokens per expert (1.0: balanced) and,
    per layer, ``moe_load_max_over_mean/<i>``. Dropless routing: no token is dropped, so there is no drop count."""
    loads = moe["loads"].to(torch.float64)
    ratio = loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-12)
    out = {"moe_aux_loss": float(moe["aux_loss"].sum()), "moe_load_max_over_mean": float(ratio.max())}
    out.update({f"moe_load_max_over_mean/{i}": float(r) for i, r in enumerate(ratio)})
    out["moe_dropped_tokens"] = 0.0  # dropless: every routed token is computed (stated, so dashboards can show it)
    return out


EXPERT_LOAD_PICTURE = "expert_load.svg"


class ImbalanceWatch:
    """Warns once when the busiest expert of some MoE layer keeps more than ``threshold`` x the mean tokens for
    ``steps`` steps in a row (routing collapsing onto a few experts); ``threshold`` 0: never. :meth:`update` takes a
    step's ``StepResult.moe`` and returns the warning line the first time the condition holds, else None."""

    def __init__(self, threshold: float, steps: int):
        self.threshold, self.steps = threshold, steps
        self.run, self.warned = 0, False

    def update(self, moe: dict, step: int) -> str | None:
        if self.warned or not self.threshold:
            return None
        loads = moe["loads"].to(torch.float64)
        ratio = loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-12)
        worst = int(ratio.argmax())
        self.run = self.run + 1 if float(ratio[worst]) > self.threshold else 0
        if self.run < self.steps:
            return None
        self.warned = True
        return (
            f"warning: MoE load: the busiest expert has held more than {self.threshold:g}x the mean tokens for "
            f"{self.steps} steps in a row (step {step}: MoE layer {worst} at {float(ratio[worst]):.2f}x); routing is "
            f"collapsing onto a few experts: "
            f"set model.load_balance_coeff (the expert-bias rate, e.g. 1e-3) or model.aux_loss_coeff (e.g. 1e-2) "
            f"(docs/moe.md; metrics.moe_imbalance_warn 0 silences this)"
        )


def write_expert_load_picture(folder: str | Path, loads: torch.Tensor, step: int) -> Path:
    """``<folder>/expert_load.svg``: the step's tokens per expert, one row per MoE layer, one cell per expert,
    coloured by load / the layer's mean (white 0, blue 1 = balanced, red >= 2; the number of tokens in each cell's
    tooltip). Rewritten whole (a temporary file renamed over it) at every log step: a browser shows the latest."""
    loads = loads.to(torch.float64)
    layers, experts = loads.shape
    cell, left, top = 14, 70, 34
    mean = loads.mean(dim=1, keepdim=True).clamp_min(1e-12)
    ratio = (loads / mean).tolist()

    def colour(r: float) -> str:
        if r <= 1.0:  # white -> blue
            t = r
            return f"rgb({round(255 * (1 - t))},{round(255 * (1 - 0.6 * t))},255)"
        t = min(r - 1.0, 1.0)  # blue -> red
        return f"rgb({round(255 * t)},{round(102 * (1 - t))},{round(255 * (1 - t))})"

    width, height = left + experts * cell + 10, top + layers * cell + 24
    worst = max(max(row) for row in ratio) if layers else 0.0
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
        f'font-size="11">',
        f'<text x="4" y="14">expert load at step {step}: {layers} layers x {experts} experts, worst max/mean '
        f"{worst:.2f}</text>",
        '<text x="4" y="28">white 0, blue = mean, red &gt;= 2 x mean</text>',
    ]
    for i, row in enumerate(ratio):
        y = top + i * cell
        out.append(f'<text x="4" y="{y + cell - 3}">layer {i}</text>')
        for e, r in enumerate(row):
            out.append(
                f'<rect x="{left + e * cell}" y="{y}" width="{cell - 1}" height="{cell - 1}" fill="{colour(r)}">'
                f"<title>layer {i} expert {e}: {int(loads[i, e])} tokens ({r:.2f} x mean)</title></rect>"
            )
    out.append("</svg>")
    path = Path(folder) / EXPERT_LOAD_PICTURE
    tmp = path.with_suffix(".svg.tmp")
    tmp.write_text("\n".join(out) + "\n")
    tmp.replace(path)
    return path
