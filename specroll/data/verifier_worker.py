"""The math-verify worker process: checks one response against its gold answer per request.

Run as ``python -m specroll.data.verifier_worker`` by :class:`specroll.data.verifier.MathVerifier`.
Requests and answers are JSON lines on stdin and stdout. The worker runs math-verify in its
own main thread, where a ``SIGALRM`` timer can interrupt a parse or a comparison that runs
past the time limit: signals reach only a main thread, which a caller may not be on (a
threaded actor, a thread pool) and whose own alarms would clash.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys

from math_verify import parse, verify

from specroll.data.verifier import READY


class OutOfTime(BaseException):
    """Raised by the timer; a BaseException, so math-verify's ``except Exception`` lets it through."""


def _on_alarm(signum, frame) -> None:
    raise OutOfTime


@functools.lru_cache(maxsize=4096)
def parsed_gold(gold: str) -> list:
    """The gold answer as math-verify reads it, parsed once per problem."""
    return parse(f"\\boxed{{{gold}}}", parsing_timeout=None)


def check(gold: str, response: str, timeout_s: float) -> bool | None:
    """Whether ``response``'s final answer equals ``gold``; None when it took over ``timeout_s``."""
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return bool(verify(parsed_gold(gold), parse(response, parsing_timeout=None), timeout_seconds=None))
    except OutOfTime:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    # Answers go to a private copy of stdout; anything else printed goes to stderr.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # math-verify warns that its own (signal-based) timeouts are off: this worker keeps time instead.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    signal.signal(signal.SIGALRM, _on_alarm)
    print(READY, file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = check(request["gold"], request["response"], request["timeout_s"])
        except OutOfTime:  # the timer fired as the check was returning
            result = None
        print(json.dumps(result), file=answers, flush=True)


if __name__ == "__main__":
    main()
