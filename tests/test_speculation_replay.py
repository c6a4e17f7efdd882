"""Replay memory of matured draft records (docs/algorithm.md, section 6): cap, ageing, split, state."""
from __future__ import annotations

import io
from dataclasses import fields, replace

import pytest
import torch

from specroll.speculation.adaptation.replay import MaturedRecords, ReplayMemory

D, H, K, M = 8, 4, 32, 8


def records(n, first_token=0, policy_version=0, seed=0, per_response=1) -> MaturedRecords:
    """n records whose `token` field numbers them first_token, first_token + 1, ..., from
    consecutive responses of `per_response` records each."""
    g = torch.Generator().manual_seed(seed)
    return MaturedRecords(
        head=torch.randint(0, H, (n,), generator=g),
        hidden=torch.randn(n, D, generator=g),  # float32: the memory stores fp16
        path_tokens=torch.randint(0, 100, (n, H), generator=g),
        token=torch.arange(first_token, first_token + n),
        target_logp=torch.randn(n, K, generator=g), target_ids=torch.randint(0, 100, (n, K), generator=g),
        target_tail=torch.randn(n, generator=g),
        proposal_logp=torch.randn(n, M, generator=g), proposal_ids=torch.randint(0, 100, (n, M), generator=g),
        proposal_tail=torch.randn(n, generator=g),
        policy_version=torch.full((n,), policy_version), head_version=torch.zeros(n, dtype=torch.long),
        bucket=torch.randint(0, 5, (n,), generator=g), response=torch.arange(n) // per_response,
    )


def tokens(recs: MaturedRecords) -> list[int]:
    return recs.token.tolist()


def test_stays_under_its_cap_dropping_and_counting_the_oldest():
    memory = ReplayMemory(capacity=100)
    assert [memory.add(records(60, first_token=60 * i)) for i in range(3)] == [0, 20, 60]
    assert len(memory) == 100 and memory.dropped == 80
    assert tokens(memory.records) == list(range(80, 180))  # newest kept, in arrival order
    assert memory.add(records(250, first_token=1000)) == 250
    assert tokens(memory.records) == list(range(1150, 1250)) and memory.dropped == 330
    # Per record: head 8 + hidden 8 * 2 (fp16) + path 4 * 8 + token 8 + target 32 * (4 + 8) + 4
    # + proposal 8 * (4 + 8) + 4 + versions 2 * 8 + bucket 8 + response 8 + arrival number 8 = 592 bytes.
    assert memory.records.hidden.dtype == torch.float16
    assert memory.nbytes == 100 * 592


def test_ages_out_older_policy_versions():
    memory = ReplayMemory(capacity=100)
    for version in (3, 4, 5):
        memory.add(records(10, first_token=10 * version, policy_version=version))
    assert memory.drop_policy_versions_before(5) == 20
    assert tokens(memory.records) == list(range(50, 60)) and memory.dropped == 0  # ageing is not eviction
    assert memory.drop_policy_versions_before(5) == 0
    assert memory.drop_policy_versions_before(6) == 10 and len(memory) == 0


def test_held_out_split_is_deterministic_disjoint_and_stable():
    memory = ReplayMemory(capacity=1000)
    memory.add(records(1000))
    train, held = memory.split(0.1, seed=7)
    again_train, again_held = memory.split(0.1, seed=7)
    assert tokens(train) == tokens(again_train) and tokens(held) == tokens(again_held)
    assert set(tokens(train)).isdisjoint(tokens(held)) and sorted(tokens(train) + tokens(held)) == list(range(1000))
    assert 98 <= len(held) <= 102  # arrival numbers spread evenly: close to 10% of any run
    assert set(tokens(memory.split(0.1, seed=8)[1])) != set(tokens(held))
    # New arrivals evict 500 old records; the survivors keep their side.
    memory.add(records(500, first_token=1000))
    later_train, later_held = memory.split(0.1, seed=7)
    assert set(tokens(later_held)) & set(range(1000)) == set(tokens(held)) & set(range(500, 1000))
    assert set(tokens(later_train)) & set(range(1000)) == set(tokens(train)) & set(range(500, 1000))


def test_a_response_is_held_out_whole():
    """Records of one response share its context: the split never puts them on both sides."""
    memory = ReplayMemory(capacity=10_000)
    for step in range(3):  # each step's batch numbers its responses from 0 again
        memory.add(records(2000, first_token=2000 * step, per_response=20))
    train, held = memory.split(0.1, seed=3)
    step_and_response = lambda recs: {(t // 2000, t % 2000 // 20) for t in tokens(recs)}  # noqa: E731
    assert step_and_response(train).isdisjoint(step_and_response(held))
    assert 29 <= len(step_and_response(held)) <= 31 and len(held) == 20 * len(step_and_response(held))  # ~10%, whole


def test_state_round_trips_through_weights_only_load():
    def reload(state):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    empty = ReplayMemory(capacity=100)
    empty.load_state_dict(reload(ReplayMemory(capacity=100).state_dict()))
    assert len(empty) == 0 and empty.records is None

    memory = ReplayMemory(capacity=100)
    for i in range(3):
        memory.add(records(60, first_token=60 * i, policy_version=i, seed=i))
    resumed = ReplayMemory(capacity=100)
    resumed.load_state_dict(reload(memory.state_dict()))
    assert (resumed.dropped, resumed.next_serial, len(resumed)) == (80, 180, 100)
    for f in fields(MaturedRecords):
        assert torch.equal(getattr(resumed.records, f.name), getattr(memory.records, f.name)), f.name
    for m in (memory, resumed):  # the same future: arrival numbers continue where they stopped
        m.add(records(30, first_token=500, seed=9))
    assert [tokens(side) for side in resumed.split(0.2, seed=1)] == [tokens(side) for side in memory.split(0.2, seed=1)]

    old_run = memory.state_dict()
    old_run["records"] = {k: v for k, v in old_run["records"].items() if k != "response"}  # saved before the field
    from_old = ReplayMemory(capacity=100)
    from_old.load_state_dict(reload(old_run))
    assert from_old.records.response.tolist() == list(range(100))  # a response per record

    smaller = ReplayMemory(capacity=40)
    smaller.load_state_dict(reload(memory.state_dict()))
    assert tokens(smaller.records) == tokens(memory.records)[-40:] and smaller.dropped == memory.dropped + 60


def test_rejects_inconsistent_batches():
    memory = ReplayMemory(capacity=10)
    with pytest.raises(ValueError, match="token has shape"):
        memory.add(replace(records(4), token=torch.arange(3)))
    memory.add(records(4))
    with pytest.raises(ValueError, match="hidden rows differ"):
        memory.add(replace(records(4), hidden=torch.zeros(4, D + 1)))
    with pytest.raises(ValueError, match="capacity"):
        ReplayMemory(capacity=0)
