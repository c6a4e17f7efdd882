"""Replay memory of matured draft records, the data of head-only updates (docs/algorithm.md, section 6).

A record is one head's proposal at one position once the target has produced that position:
what the head read (h_t and the path tokens), what it proposed (top-m + tail), and what the
target said (top-K + tail, and the realised token). The memory keeps at most `capacity`
records, dropping the oldest first; records of an older policy can be aged out.

The held-out split is by response: a function of the arrival number of each record's response
and the seed only. So a record never moves between the two sides as records come and go (a
record trained on at one update is never held out at the next), and no held-out record shares
its response, and so its context, with a training record: the commit test judges the heads on
responses they were not trained on.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

GOLDEN = (math.sqrt(5) - 1) / 2  # Weyl step: arrival numbers spread evenly over [0, 1)
MATRIX_FIELDS = ("hidden", "path_tokens", "target_logp", "target_ids", "proposal_logp", "proposal_ids")  # [N, *]


@dataclass(frozen=True, eq=False)  # tensors: compare fields with torch.equal
class MaturedRecords:
    """A batch of N matured records (one per head proposal); ids are model token ids."""

    head: torch.Tensor  # [N] int head k (0-based) that proposed
    hidden: torch.Tensor  # [N, D] fp16 h_t, the policy's final hidden state every head starts from
    path_tokens: torch.Tensor  # [N, H] int x_{t+1}..x_{t+H} on the drafted path; head k reads the first k+1
    token: torch.Tensor  # [N] int realised token x_{t+k+2}, the one head k predicted
    target_logp: torch.Tensor  # [N, K] float log-probs of the target's K most likely tokens (K = 32)
    target_ids: torch.Tensor  # [N, K] int those tokens
    target_tail: torch.Tensor  # [N] float log-mass of the target outside them
    proposal_logp: torch.Tensor  # [N, M] float log-probs of the head's m most likely tokens when it drafted
    proposal_ids: torch.Tensor  # [N, M] int those tokens
    proposal_tail: torch.Tensor  # [N] float log-mass of the head outside them
    policy_version: torch.Tensor  # [N] int policy whose verify pass gave the target side
    head_version: torch.Tensor  # [N] int heads that made the proposal
    bucket: torch.Tensor  # [N] int depth bucket (drift.depth_bucket of tokens generated so far)
    response: torch.Tensor  # [N] int the response it comes from (its index in the generate call's output)

    def __len__(self) -> int:
        return self.head.shape[0]

    def validate(self) -> None:
        """Raise `ValueError` unless every field has N rows and its documented rank."""
        n = len(self)
        for f in fields(self):
            t = getattr(self, f.name)
            rank = 2 if f.name in MATRIX_FIELDS else 1
            if t.dim() != rank or t.shape[0] != n:
                raise ValueError(f"matured records: {f.name} has shape {list(t.shape)}, expected {rank} dims "
                                 f"and {n} rows")
        if self.target_logp.shape != self.target_ids.shape or self.proposal_logp.shape != self.proposal_ids.shape:
            raise ValueError("matured records: log-probs and ids differ in shape")

    def select(self, index: torch.Tensor) -> "MaturedRecords":
        """The records at `index` [n] (int positions or a bool mask [N])."""
        return MaturedRecords(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> "MaturedRecords":
        if "response" not in state:  # saved before records named their response: one each
            state = state | {"response": torch.arange(len(state["head"]))}
        return cls(**{f.name: state[f.name] for f in fields(cls)})


def cat_records(parts: Sequence[MaturedRecords]) -> MaturedRecords:
    """Records of `parts` one after the other; every part must agree on D, H, K and M."""
    for f in fields(MaturedRecords):
        shapes = {tuple(getattr(p, f.name).shape[1:]) for p in parts}
        if len(shapes) > 1:
            raise ValueError(f"matured records: {f.name} rows differ in shape across batches: {sorted(shapes)}")
    return MaturedRecords(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(MaturedRecords)})


def held_out_mask(serial: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """[N] bool: which records (by their response's arrival number serial [N]) are held out; about
    `fraction` of any run of consecutive arrivals, and the same answer whenever it is asked."""
    offset = (seed * math.sqrt(2)) % 1.0
    return ((serial.double() * GOLDEN + offset) % 1.0) < fraction


class ReplayMemory:
    """At most `capacity` matured records, oldest dropped first; on the CPU (records arrive over Ray)."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"replay capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.records: MaturedRecords | None = None  # oldest first; None until the first add
        self.serial = torch.zeros(0, dtype=torch.long, device="cpu")  # [len] arrival number of each record's response
        self.next_serial = 0  # arrival number of the next response added
        self.dropped = 0  # records evicted by the cap since the start of the run (heads/replay_dropped)

    def __len__(self) -> int:
        return 0 if self.records is None else len(self.records)

    @property
    def nbytes(self) -> int:
        return (0 if self.records is None else self.records.nbytes) + self.serial.nbytes

    def add(self, batch: MaturedRecords) -> int:
        """Append a batch (hidden stored as fp16); returns how many of the oldest records the cap evicted."""
        batch.validate()
        columns = {f.name: getattr(batch, f.name).cpu() for f in fields(batch)}
        columns["hidden"] = columns["hidden"].half()  # fp16 halves the memory's largest field
        batch = MaturedRecords(**columns)
        # Every response of the batch (one step's records) is a new arrival; rollout actors number
        # theirs alike, so two of them may share one: never split all the same.
        responses, serial = torch.unique(batch.response, return_inverse=True)
        serial = serial + self.next_serial
        self.next_serial += len(responses)
        self.records = batch if self.records is None else cat_records([self.records, batch])
        self.serial = torch.cat([self.serial, serial])
        return self.evict_oldest()

    def evict_oldest(self) -> int:
        excess = max(0, len(self) - self.capacity)
        if excess:
            self.keep(torch.arange(excess, len(self), device="cpu"))
            self.dropped += excess
        return excess

    def drop_policy_versions_before(self, version: int) -> int:
        """Age out records whose target side came from a policy older than `version`; returns how many."""
        if self.records is None:
            return 0
        old = self.records.policy_version < version
        self.keep(~old)
        return int(old.sum())

    def keep(self, index: torch.Tensor) -> None:
        self.records = self.records.select(index)
        self.serial = self.serial[index]

    def split(self, held_out_fraction: float = 0.1, seed: int = 0) -> tuple[MaturedRecords, MaturedRecords]:
        """(train, held out): disjoint, together all records, deterministic in (records, seed); a
        response's records all on one side.

        About `held_out_fraction` of the responses are held out; with few responses either side
        may be empty, and the caller decides whether that is enough to update on.
        """
        if not 0 <= held_out_fraction <= 1:
            raise ValueError(f"held_out_fraction must be in [0, 1], got {held_out_fraction}")
        if self.records is None:
            raise ValueError("the replay memory is empty: add records before splitting")
        held = held_out_mask(self.serial, held_out_fraction, seed)
        return self.records.select(~held), self.records.select(held)

    # -- persistence ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain tensors and numbers: loadable with torch.load(weights_only=True)."""
        return {"next_serial": self.next_serial, "dropped": self.dropped, "serial": self.serial,
                "records": None if self.records is None else self.records.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Adopt saved records; a smaller capacity than the saved run's evicts the oldest."""
        self.next_serial, self.dropped = int(state["next_serial"]), int(state["dropped"])
        self.serial = state["serial"].cpu()
        self.records = None if state["records"] is None else MaturedRecords.from_state_dict(
            {k: v.cpu() for k, v in state["records"].items()})
        self.evict_oldest()
