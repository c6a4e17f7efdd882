"""Equivalence of LaTeX answers through math-verify, each response within a time limit."""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import threading
from collections.abc import Sequence

READY = "ready"  # the worker's first line, once math-verify is imported
# How long past the worker's own time limit it may stay silent before it is killed and restarted.
_GRACE_S = 5.0
_WORKER = "specroll.data.verifier_worker"


class MathVerifier:
    """Checks responses against gold answers with math-verify, in a worker process.

    math-verify compares expressions, not strings: ``\\frac{1}{2}`` equals ``0.5`` and
    ``\\sqrt{8}`` equals ``2\\sqrt{2}``. Its parser and sympy can run for minutes on a hostile
    response, and only a signal or a kill stops them, so the checks run in a worker process
    (:mod:`specroll.data.verifier_worker`) that stops each one at ``timeout_s`` and answers
    "wrong"; a worker silent for ``timeout_s`` + 5 s is killed and started afresh. Nothing here
    uses signals, so any thread may call :meth:`check` (calls are serialised).

    Args:
        timeout_s: longest one response's check may take; past it the response counts as wrong.
        start_timeout_s: longest the worker may take to start (to import math-verify and sympy).
    """

    def __init__(self, timeout_s: float, start_timeout_s: float = 120.0) -> None:
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.timed_out = 0  # checks stopped at the time limit, since this verifier was made
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def check(self, golds: Sequence[str], responses: Sequence[str]) -> list[bool]:
        """Whether each response's final answer equals its gold answer (a LaTeX expression or a number)."""
        if len(golds) != len(responses):
            raise ValueError(f"need one gold answer per response, got {len(golds)} and {len(responses)}")
        with self._lock:
            return [self._check_one(gold, response) for gold, response in zip(golds, responses)]

    def close(self) -> None:
        """Stop the worker; the next check starts a new one."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()
            for pipe in (process.stdin, process.stdout):
                with contextlib.suppress(OSError):  # a request the dead worker never read
                    pipe.close()

    def _check_one(self, gold: str, response: str) -> bool:
        process = self._running()
        request = json.dumps({"gold": gold, "response": response, "timeout_s": self.timeout_s})
        try:
            process.stdin.write(request + "\n")
            process.stdin.flush()
            answer = _read_line(process, self.timeout_s + _GRACE_S)
        except OSError:  # the worker died, e.g. killed for memory by a huge computation
            answer = None
        if answer is None or answer == "null":
            self.timed_out += 1
            if answer is None:
                self.close()
            return False
        return json.loads(answer) is True

    def _running(self) -> subprocess.Popen:
        """The worker, started now if there is none or it died."""
        if self._process is not None and self._process.poll() is None:
            return self._process
        self.close()
        process = subprocess.Popen([sys.executable, "-m", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, encoding="utf-8")
        if _read_line(process, self.start_timeout_s) != READY:
            process.kill()
            process.wait()
            raise RuntimeError(f"the math-verify worker ({_WORKER}) did not start within {self.start_timeout_s} s; "
                               "is math-verify installed? Its own error, if any, is printed above")
        self._process = process
        return process


def _read_line(process: subprocess.Popen, timeout_s: float) -> str | None:
    """The worker's next line, or None when it wrote none within ``timeout_s`` or exited."""
    readable, _, _ = select.select([process.stdout], [], [], timeout_s)
    line = process.stdout.readline() if readable else ""
    return line.rstrip("\n") if line.endswith("\n") else None
