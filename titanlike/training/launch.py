"""``python train.py --nproc_per_node N ...``: torchrun on one node, with titanlike's checks first and its words last.

Under plain ``torchrun`` a refusal is our one line, then torchrun's own report of a failed worker (~40 lines) and
exit code 1, whatever the worker's code was. This launcher runs the same elastic agent as ``torchrun --standalone
--nproc_per_node N`` (``torch.distributed.run``), with three differences:

* the configuration is checked here, against ``N`` processes, before any worker starts: bad input is one line and
  exit code 2, as for one process;
* the agent's own log lines are not printed (the workers print what happened: the first to fail says why);
* the job's exit code is the worker's: 2 for a refusal a worker found (a data file, a tokenizer), 75 for a run that
  saved on an exit signal and will resume, the worker's own code otherwise — and one line naming the rank whose
  failure ended the job when it is not a refusal.

Several nodes, elastic restarts or any other torchrun flag: use ``torchrun`` itself.
"""

from __future__ import annotations

import logging
import signal
import sys

from titanlike.config import load_config
from titanlike.errors import ConfigError
from titanlike.training.exit_signals import EXIT_PREEMPTED

__all__ = ["LAUNCH_FLAGS", "launch", "split_launch_flag"]

LAUNCH_FLAGS = ("--nproc_per_node", "--nproc-per-node")


def split_launch_flag(argv: list[str]) -> tuple[int | None, list[str]]:
    """``(N, the other options)`` when ``argv`` asks for ``--nproc_per_node N`` (or ``=N``), else ``(None, argv)``."""
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if flag not in LAUNCH_FLAGS:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        rest = argv[:i] + argv[i + (1 if eq else 2) :]
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{flag}: the number of processes is a positive integer, got {value!r}")
        return int(value), rest
    return None, argv


def launch(nproc: int, argv: list[str], script: str) -> int:
    """Check ``argv`` for ``nproc`` ranks, then run ``script argv`` on ``nproc`` local processes; the exit code."""
    cfg = load_config(argv, world_size=nproc)  # ConfigError: the caller prints it, exit 2, nothing started
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}", script, *argv])
    _quiet_agent()
    try:
        run(args)
    except ChildFailedError as e:
        return _failed(e)
    except SignalException as e:  # the job was signalled: the workers got it too and said what they did
        saves = cfg.checkpoint.enable and e.sigval in {signal.Signals[s] for s in cfg.checkpoint.exit_signals}
        return EXIT_PREEMPTED if saves else 128 + int(e.sigval)
    return 0


def _failed(e) -> int:
    """The exit code of the worker whose failure ended the job (torchrun's "root cause"), with one line unless the
    worker's own line already said it all (a refusal, a resumable save)."""
    rank, failure = e.get_first_failure()
    code = failure.exitcode
    if code in (2, EXIT_PREEMPTED):
        return code
    if code < 0:
        name = signal.Signals(-code).name
        print(f"error: rank {rank} was killed by {name}; the job was stopped", file=sys.stderr, flush=True)
        return 128 - code
    print(f"error: rank {rank} exited with code {code} (its output is above); the job was stopped", file=sys.stderr)
    return code


def _quiet_agent() -> None:
    """The elastic agent's loggers (each sets its own level from ``LOGLEVEL``) print nothing below CRITICAL."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.CRITICAL)
