"""Exit signals (``checkpoint.exit_signals``, default SIGTERM, SIGUSR1 and SIGINT): a scheduler's notice that the
job is about to be stopped (Slurm's ``--signal``, a preemption, ``scancel``, a Kubernetes eviction) or the user's
Ctrl-C becomes a checkpoint of the step being trained instead of lost work.

The handler only records the signal. At the end of every step the ranks agree whether any of them got one, in one
all-reduce of a host tensor on gloo that waits for no device work (:meth:`Trainer._agree_on_exit_signal`); then every
rank has finished the same step, the job saves it synchronously (even with ``checkpoint.async_mode = "async"``) and
exits with :data:`EXIT_PREEMPTED`, which a requeue script tests; the same command resumes at that step.

A further signal (a second Ctrl-C) before the step ends or while that save runs makes the process exit at once (code
128 + the signal's number), leaving the previous checkpoint as it was: the save writes into a temporary folder that
only its final rename commits, exactly as under kill -9. Copies arriving within :data:`DUPLICATE_WINDOW_S` of the
first are the same notice (a scheduler signals every process of a job, and torchrun forwards its own copy to its
workers).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

# os.EX_TEMPFAIL (sysexits.h: "a temporary failure; the user is invited to retry"): saved, run the same command again
EXIT_PREEMPTED = 75
DUPLICATE_WINDOW_S = 5.0


class Preempted(Exception):
    """The run stopped on an exit signal after saving its step; ``main`` exits with :data:`EXIT_PREEMPTED`."""

    def __init__(self, message: str, *, step: int, signal_name: str, losses: list[float]):
        super().__init__(message)
        self.step, self.signal_name, self.losses = step, signal_name, losses


class ExitSignals:
    """Handlers for the named signals while training runs (:meth:`install` in the main thread, :meth:`restore`; as
    a context manager, both). ``received`` is the number of the first signal (0: none). ``on_exit`` runs just before
    a second signal during the save ends the process (the run lock's release)."""

    def __init__(self, names: Sequence[str], on_exit: Callable[[], None] | None = None):
        self.signals = [signal.Signals[name] for name in names]
        self.on_exit = on_exit
        self.received = 0
        self.received_at = 0.0
        self.saving = False
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> bool:
        """Install the handlers; False (nothing installed) off the main thread, where Python cannot."""
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> ExitSignals:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum: int, frame) -> None:
        if not self.received:
            self.received, self.received_at = signum, time.monotonic()
            return
        if time.monotonic() - self.received_at >= DUPLICATE_WINDOW_S:
            name = signal.Signals(signum).name
            if os.environ.get("RANK", "0") == "0":  # every rank gets it (Ctrl-C signals the whole job): one line
                what = (
                    "during the checkpoint save on an exit signal: exiting at once; the previous checkpoint is intact "
                    "(the interrupted save is removed at the next start)"
                    if self.saving
                    else "before the step finished: exiting at once without saving; the previous checkpoint is intact"
                )
                os.write(2, f"error: {name} again {what}\n".encode())
            if self.on_exit is not None:
                self.on_exit()
            os._exit(128 + signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
