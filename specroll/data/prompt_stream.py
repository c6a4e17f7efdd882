"""An endless, resumable stream of problem batches."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

from specroll.config_checks import check_int, check_seed
from specroll.data.problems import Problem


class PromptStream:
    """Yields batches of problems forever, epoch after epoch.

    Each epoch visits every problem once, in an order shuffled from ``(seed, epoch)``, so the
    order of any epoch can be rebuilt from the seed alone. A batch that reaches the end of an
    epoch is completed from the start of the next one. ``state_dict`` records the position,
    and a stream built from the same problems, batch size and seed continues from it exactly.
    """

    def __init__(
        self, problems: Iterable[Problem], batch_size: int, seed: int, shuffle: bool = True
    ) -> None:
        # A private copy, so that the caller editing its list cannot shift resumed positions.
        self._problems = tuple(problems)
        if not self._problems:
            raise ValueError("PromptStream needs at least one problem, got none")
        check_int("batch_size", batch_size, 1)
        check_seed("seed", seed)
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._seek(epoch=0, index=0)

    def _seek(self, epoch: int, index: int) -> None:
        self._epoch, self._index = epoch, index
        self._order = list(range(len(self._problems)))
        if self._shuffle:
            # A string seed is hashed with SHA-512, so the order is stable across processes.
            random.Random(f"{self._seed}/{epoch}").shuffle(self._order)

    @property
    def epoch(self) -> int:
        """The epoch the next problem comes from, counting from 0."""
        return self._epoch

    def __iter__(self) -> Iterator[list[Problem]]:
        return self

    def __next__(self) -> list[Problem]:
        return self.take(self._batch_size)

    def take(self, count: int) -> list[Problem]:
        """The next `count` problems (dynamic sampling's extra rounds draw these between batches)."""
        check_int("count", count, 1)
        batch = []
        while len(batch) < count:
            batch.append(self._problems[self._order[self._index]])
            if self._index + 1 == len(self._problems):
                self._seek(self._epoch + 1, 0)
            else:
                self._index += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """The position of the next problem: ``{"epoch": ..., "index": ...}``."""
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by :meth:`state_dict`."""
        for key in ("epoch", "index"):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"state[{key!r}] must be an int >= 0, got {value!r}")
        if state["index"] >= len(self._problems):
            raise ValueError(
                f"state['index']={state['index']} is past the {len(self._problems)} problems "
                "of this stream; was it saved from a different problem set?"
            )
        self._seek(state["epoch"], state["index"])
