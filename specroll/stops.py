"""Ending a run on SIGTERM (`ray job stop`, `kill`, a scheduler) or SIGINT (Ctrl-C): at once, in one line.

The stop is immediate, not at the end of the step: `ray job stop` follows its SIGTERM with
SIGKILL after 3 s (RAY_JOB_STOP_WAIT_TIME_S) and schedulers after their grace period, so a run
that finished its step first would mostly be killed with nothing said. What it leaves is
consistent all the same: a checkpoint being saved is finished first (the one phase a stop waits
for; a second signal does not wait, leaving a `.tmp` save that no resume picks), and a step's
metrics line without its checkpoint is redone and replaced by the resumed run. The driver then
closes its files, ends the actors and Ray, gives up the run_dir and exits 128 + the signal's
number (143, 130), the shell's code for a process ended by it.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(BaseException):
    """The run ended on a stop signal, and is torn down. A BaseException, like KeyboardInterrupt: no
    `except Exception` holds it up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.where = "while starting (no step ran)"
        self.checkpoint: Path | None = None  # the newest complete checkpoint, once known
        self.command = "run again with resume=auto"  # what continues the run; main() names the whole command

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        if self.checkpoint is None:
            return (f"stopped by {self.name} {self.where}; no checkpoint was completed yet, so a rerun starts "
                    "from step 0")
        return (f"stopped by {self.name} {self.where}; the last complete checkpoint is {self.checkpoint}; "
                f"to continue from it: {self.command}")


class StopSignals:
    """While entered in the main thread, SIGTERM and SIGINT raise KeyboardInterrupt there, the one
    exception Ray's waits let through whole (any other leaves them as a SystemError), with the
    signal kept as `received` for the driver to raise `RunStopped`; inside `deferred()` the stop
    waits for the block to end. After the first stop a further signal has its default effect (the
    process ends at once), so a stuck teardown can still be ended."""

    def __init__(self) -> None:
        self.previous: dict[int, object] = {}
        self.deferring = False
        self.pending: int | None = None  # a signal `deferred()` holds back
        self.received: int | None = None  # the signal that stopped the run

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
            self.install()
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def install(self) -> None:
        """Take the signals (again): `ray.init` sets a SIGTERM handler of its own, and under it Ray's
        native crash handler, which prints a stack dump and leaves the process to abort (exit 134)."""
        for s in self.previous:
            signal.signal(s, self.handle)

    @contextmanager
    def around_ray_init(self) -> Iterator[None]:
        """`ray.init` takes SIGTERM for itself while it starts (its handler exits with status 15): that
        exit becomes the stop it was, and the signals are taken back once Ray has started."""
        try:
            yield
        except SystemExit as exc:
            if self.previous and exc.code == signal.SIGTERM:
                self.stop(signal.SIGTERM)
            raise
        self.install()

    def handle(self, signum: int, frame) -> None:
        if self.deferring and self.pending is None:
            self.pending = signum
            return
        self.stop(signum)

    def stop(self, signum: int) -> None:
        self.received = signum
        for s in self.previous:
            signal.signal(s, signal.SIG_DFL)
        raise KeyboardInterrupt

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A block a stop does not interrupt (a checkpoint's save): a signal during it stops the run
        when it ends; a second one stops it at once."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.pending is not None:
            self.stop(self.pending)
