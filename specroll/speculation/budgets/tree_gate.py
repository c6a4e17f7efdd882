"""Whether sync-free tree steps pay: the tokens a row gets from them against what they cost.

The concurrency budget sizes trees by the hardware's capacity alone (docs/algorithm.md, section 3),
which takes drafting and judging a tree to cost little beside its verify forward and the
drafts to be accepted. Where either fails (a GPU step bound by kernel launches, heads that
draft poorly for this policy), a tree step emits fewer tokens per second than a plain step.
A hardware profile timed through whole tree steps (`HardwareProfile.tree_steps`) gives both
costs; what each node bucket's trees emit per live row is counted on the device as they run
and read on the host every READ_EVERY tree steps (the only reads sync-free trees then make).
While a bucket's trees lose, the budget runs a smaller bucket's that pay, or plain steps, and
the bucket gets a probe tree (read at once) once PROBE_EVERY steps have passed without trees of
its size or larger, so its estimate can recover; each probe that leaves it closed doubles its
wait, up to MAX_PROBE_EVERY, so heads that never pay cost ever less.
"""
from __future__ import annotations

import torch

from .hardware_profile import HardwareProfile

READ_EVERY = 16  # tree steps between two host reads of the counts (a read waits for the GPU)
PROBE_EVERY = 64  # steps without a closed bucket's trees before a probe measures it again
MAX_PROBE_EVERY = 1024  # the longest wait, after probes in a row that left the bucket closed
DECAY = 0.5  # weight of the rows counted before a read: the estimate follows what trees emit now


def trees_pay(tokens_per_row: float, plain_s: float, tree_s: float, min_gain: float) -> bool:
    """Whether a tree step that emits `tokens_per_row` per row in `tree_s` seconds beats a plain
    step's one token in `plain_s` by more than the fraction `min_gain`."""
    return tokens_per_row * plain_s > (1 + min_gain) * tree_s


class TreeGate:
    """Per node bucket, tokens per live row of the sync-free tree steps run so far (decayed sums
    over host reads, so a one-row probe moves an estimate made of many rows little), and whether
    the next tree of a bucket should run."""

    def __init__(self, buckets: list[int], max_tokens: int, min_gain: float, device) -> None:
        self.buckets, self.min_gain = buckets, min_gain
        # Per bucket, live row-steps that emitted k = 0..max_tokens tokens since the last read.
        self.unread = torch.zeros(len(buckets), max_tokens + 1, dtype=torch.long, device=device)
        self.reset()

    def reset(self) -> None:
        """Forget every estimate (other heads draft now)."""
        self.unread.zero_()
        self.unread_steps = 0
        self.tokens = [0.0] * len(self.buckets)  # decayed sums of tokens emitted and of live row-steps
        self.rows = [0.0] * len(self.buckets)
        self.steps_without = [0] * len(self.buckets)  # steps since a tree of each bucket or a larger one
        self.heads_updated()

    def heads_updated(self) -> None:
        """Probe closed buckets after PROBE_EVERY steps again (the heads may draft better now)."""
        self.closed_probes = [0] * len(self.buckets)  # per bucket, probes in a row that left it closed

    def probe_interval(self, bucket: int) -> int:
        """Steps without trees of `bucket` or larger before its next probe: PROBE_EVERY,
        doubled for each probe in a row that left it closed, up to MAX_PROBE_EVERY."""
        return min(PROBE_EVERY << self.closed_probes[self.buckets.index(bucket)], MAX_PROBE_EVERY)

    def tokens_per_row(self, bucket: int) -> float | None:
        """What a live row emits per tree step of `bucket`; None before one is read."""
        i = self.buckets.index(bucket)
        return self.tokens[i] / self.rows[i] if self.rows[i] else None

    def allows(self, profile: HardwareProfile, batch: int, bucket: int) -> bool:
        """Whether `batch` rows should run trees of `bucket` nodes: yes until the bucket has been
        measured, then where its trees pay by the profile, and as a probe (see `probe_interval`)."""
        estimate = self.tokens_per_row(bucket)
        if estimate is None or self.steps_without[self.buckets.index(bucket)] >= self.probe_interval(bucket):
            return True
        return trees_pay(estimate, profile.latency(batch, 1), profile.latency(batch, bucket), self.min_gain)

    def largest_allowed(self, profile: HardwareProfile, batch: int, limit: int) -> int | None:
        """The largest bucket up to `limit` whose trees `batch` rows should run (a smaller tree
        verifies in a cheaper bucket); None: none, a plain step."""
        allowed = (b for b in sorted(self.buckets, reverse=True) if b <= limit and self.allows(profile, batch, b))
        return next(allowed, None)

    def note_tree(self, bucket: int, by_tokens: torch.Tensor) -> None:
        """A tree step ran in `bucket`; `by_tokens` [max_tokens + 1]: its live rows that emitted k
        tokens (a device tensor: added without a host read, read every READ_EVERY steps)."""
        i = self.buckets.index(bucket)
        self.unread[i] += by_tokens
        # After steps without trees this large it is a probe, mostly: read it, the next is far off,
        # and count it (for the smaller buckets too) as one that left them closed unless trees of
        # this size run again next step.
        probe = self.steps_without[i] > 0
        self.closed_probes = [(n + 1 if probe else 0) if b <= bucket else n
                              for b, n in zip(self.buckets, self.closed_probes)]
        self.note_step(bucket)
        self.unread_steps += 1
        if probe or self.unread_steps >= READ_EVERY:
            self.read()

    def note_plain(self) -> None:
        self.note_step(None)

    def note_step(self, bucket: int | None) -> None:
        """A step ran `bucket`'s trees (None: a plain step). A larger tree counts for the smaller
        buckets too, so where all are closed one probe, of the largest, serves them all."""
        ran = 0 if bucket is None else bucket
        self.steps_without = [0 if b <= ran else n + 1 for b, n in zip(self.buckets, self.steps_without)]

    def read(self) -> None:
        """Fold the counts since the last read into each bucket's sums (one host read)."""
        if not self.unread_steps:
            return
        emitted = torch.arange(self.unread.shape[1], device=self.unread.device)
        counts = torch.stack(((self.unread * emitted).sum(1), self.unread.sum(1)), 1).tolist()
        self.unread.zero_()
        self.unread_steps = 0
        for i, (tokens, rows) in enumerate(counts):
            if rows:
                self.tokens[i] = DECAY * self.tokens[i] + tokens
                self.rows[i] = DECAY * self.rows[i] + rows
