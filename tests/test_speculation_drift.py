"""Drift detector of the slow path (docs/algorithm.md, section 6): robust z, schedule, cooldown, state."""
from __future__ import annotations

import io
import math

import pytest
import torch

from specroll.speculation.adaptation.drift_detector import (
    DriftConfig,
    DriftDetector,
    HeadTelemetry,
    acceptance_z,
    depth_bucket,
    merge_telemetry,
    robust_baseline,
    robust_z,
)

H, B = 4, 5  # heads, depth buckets (the default edges give 5)
BASE_TV = torch.tensor([0.20, 0.30, 0.40, 0.50], dtype=torch.float64)[:, None].expand(H, B)
BASE_ACCEPTANCE = torch.tensor([0.70, 0.55, 0.45, 0.35], dtype=torch.float64)
SIGMA = 0.02  # per-step noise of a bucket's mean TV
TV_RULE = DriftConfig(signal="tv")  # the design's rule, which most tests here work by hand


def telemetry(tv, acceptance, records=100, trials=1000) -> HeadTelemetry:
    """One step: tv [H, B], acceptance [H]; `records` matured records and `trials` drafts per cell."""
    tv = torch.as_tensor(tv, dtype=torch.float64).expand(H, B)
    accepted = (torch.as_tensor(acceptance, dtype=torch.float64)[:, None] * trials).round().long().expand(H, B)
    return HeadTelemetry(records=torch.full((H, B), records), tv=tv.clone(), nll=torch.ones(H, B, dtype=torch.float64),
                         gate=torch.zeros(H, B, dtype=torch.float64), accepted=accepted.clone(),
                         trials=torch.full((H, B), trials))


def run(detector, steps, tv_shift=lambda step: 0.0, acceptance_shift=lambda step: 0.0, seed=0, records=100):
    """Feed `steps` steps of noisy stationary telemetry plus shifts ([H] or scalar per step); the checks."""
    g = torch.Generator().manual_seed(seed)
    checks = []
    for _ in range(steps):
        step = detector.step + 1
        tv = BASE_TV + SIGMA * torch.randn(H, B, generator=g, dtype=torch.float64)
        tv = tv + torch.as_tensor(tv_shift(step), dtype=torch.float64).reshape(-1, 1)
        acc = BASE_ACCEPTANCE + 0.01 * torch.randn(H, generator=g, dtype=torch.float64)
        acc = acc - torch.as_tensor(acceptance_shift(step), dtype=torch.float64)
        check = detector.observe(telemetry(tv, acc, records))
        if check is not None:
            checks.append(check)
    return checks


def from_step(start, amount, heads=(0,)):
    """A shift of `amount` for `heads` from step `start` on."""
    vector = torch.zeros(H, dtype=torch.float64)
    vector[list(heads)] = amount
    return lambda step: vector if step >= start else 0.0


def event_steps(checks):
    return [c.step for c in checks if c.event is not None]


def test_robust_z_by_hand():
    # One head, two buckets, four calibration steps.
    samples = torch.tensor([[0.1, 0.4], [0.2, 0.4], [0.3, 0.4], [0.5, 0.4]], dtype=torch.float64)[:, None, :]
    median, scale = robust_baseline(samples, mad_floor=0.01)
    # Bucket 0: median (0.2 + 0.3) / 2 = 0.25; |deviations| 0.15 0.05 0.05 0.25 -> MAD 0.1 -> 0.14826.
    # Bucket 1: constant, MAD 0 -> the floor 0.01.
    assert median.flatten().tolist() == pytest.approx([0.25, 0.4])
    assert scale.flatten().tolist() == pytest.approx([0.14826, 0.01])
    z = robust_z(torch.tensor([[0.55, 0.41]]), torch.tensor([[30, 10]]), median, scale)
    # (30 * 0.30 / 0.14826 + 10 * 0.01 / 0.01) / 40 = (60.7042 + 10) / 40
    assert z.tolist() == pytest.approx([(30 * 0.30 / 0.14826 + 10 * 1.0) / 40])


def test_bucket_without_baseline_is_left_out_of_z():
    median = torch.tensor([[0.2, math.nan]], dtype=torch.float64)
    scale = torch.tensor([[0.1, math.nan]], dtype=torch.float64)
    z = robust_z(torch.tensor([[0.4, 0.9]]), torch.tensor([[10, 1000]]), median, scale)
    assert z.tolist() == pytest.approx([2.0])
    assert robust_z(torch.tensor([[0.4, 0.9]]), torch.tensor([[0, 1000]]), median, scale).isnan().all()


def test_detector_calibration_matches_the_hand_worked_baseline():
    cfg = DriftConfig(calibration_steps=4, depth_buckets=(128,), signal="tv")
    detector = DriftDetector(cfg, num_heads=1)
    for tv0, acc in ((0.1, 0.5), (0.2, 0.7), (0.3, 0.6), (0.5, 0.6)):
        t = HeadTelemetry(records=torch.tensor([[50, 20]]), tv=torch.tensor([[tv0, 0.4]], dtype=torch.float64),
                          nll=torch.zeros(1, 2, dtype=torch.float64), gate=torch.zeros(1, 2, dtype=torch.float64),
                          accepted=torch.tensor([[int(acc * 100), 0]]), trials=torch.tensor([[100, 0]]))
        assert detector.observe(t) is None
    assert detector.calibrated
    assert detector.tv_median.flatten().tolist() == pytest.approx([0.25, 0.4])
    assert detector.tv_scale.flatten().tolist() == pytest.approx([0.14826, 0.01])
    assert detector.baseline_acceptance.tolist() == pytest.approx([(50 + 70 + 60 + 60) / 400])


def test_telemetry_merges_by_count_and_buckets_by_tokens_so_far():
    assert depth_bucket(torch.tensor([0, 127, 128, 255, 256, 1023, 1024, 5000]), (128, 256, 512, 1024)).tolist() == \
        [0, 0, 1, 1, 2, 3, 4, 4]
    a = HeadTelemetry.from_records(2, 2, head=torch.tensor([0, 0, 1]), bucket=torch.tensor([0, 0, 1]),
                                   tv=torch.tensor([0.1, 0.3, 0.5]), nll=torch.tensor([1.0, 2.0, 3.0]),
                                   gate=torch.tensor([0.0, 1.0, 1.0]))
    b = HeadTelemetry.from_records(2, 2, head=torch.tensor([0]), bucket=torch.tensor([0]),
                                   tv=torch.tensor([0.8]), nll=torch.tensor([6.0]), gate=torch.tensor([1.0]))
    trials = HeadTelemetry.from_trials(2, 2, head=torch.tensor([0, 0, 1]), bucket=torch.tensor([0, 1, 1]),
                                       accepted=torch.tensor([True, False, True]))
    merged = merge_telemetry([a, b, trials])
    assert merged.records.tolist() == [[3, 0], [0, 1]]
    assert merged.tv.flatten().tolist() == pytest.approx([(0.1 + 0.3 + 0.8) / 3, 0.0, 0.0, 0.5])
    assert merged.nll.flatten().tolist() == pytest.approx([3.0, 0.0, 0.0, 3.0])
    assert merged.gate.flatten().tolist() == pytest.approx([2 / 3, 0.0, 0.0, 1.0])
    assert merged.accepted.tolist() == [[1, 0], [0, 1]] and merged.trials.tolist() == [[1, 1], [0, 1]]
    assert merged.acceptance().tolist() == pytest.approx([0.5, 1.0])


def test_no_trigger_on_stationary_noise():
    checks = run(DriftDetector(TV_RULE, H), 400, seed=3)
    assert [c.step for c in checks] == list(range(40, 401, 20))
    assert event_steps(checks) == []
    assert max(c.z_max for c in checks) < TV_RULE.z_threshold


@pytest.mark.parametrize("start, expected", [(21, 60), (45, 80)])
def test_sustained_shift_triggers_at_the_expected_check(start, expected):
    # Checks at calibration_steps + j * check_every = 40, 60, 80, ...; the first window that is
    # degraded (shift from 21: window 21-40; from 45: window 41-60, 16 of 20 steps shifted,
    # z ~ 0.8 * 0.2 / 0.02 and drop 0.8 * 0.15) plus consecutive - 1 = 1 more check.
    checks = run(DriftDetector(TV_RULE, H), expected + 30, from_step(start, 0.2, heads=(1,)),
                 from_step(start, 0.15, heads=(1,)))
    assert event_steps(checks) == [expected]
    event = checks[[c.step for c in checks].index(expected)].event
    assert event.heads == (1,) and event.z[0] > 2.5


def test_tv_rise_without_acceptance_drop_does_not_trigger():
    checks = run(DriftDetector(TV_RULE, H), 200, from_step(21, 0.2, heads=(1,)))
    assert event_steps(checks) == []
    assert all(c.z[1] > 2.5 and not c.degraded[1] for c in checks)


def test_acceptance_z_by_hand():
    # 600 / 1000 -> 250 / 500: pooled p = 850 / 1500; se = sqrt(p (1 - p) (1/1000 + 1/500)) = 0.027142
    z = acceptance_z(torch.tensor([600]), torch.tensor([1000]), torch.tensor([250]), torch.tensor([500]))
    assert z.tolist() == pytest.approx([0.1 / 0.027142], rel=1e-4)
    assert acceptance_z(torch.tensor([6]), torch.tensor([10]), torch.tensor([0]), torch.tensor([0])).isnan().all()


def test_acceptance_signal_fires_on_a_drop_that_tv_does_not_show():
    """The case TV misses: acceptance falls by 0.15 from step 21 while TV stays put."""
    shift = from_step(21, 0.15, heads=(1,))
    assert event_steps(run(DriftDetector(TV_RULE, H), 100, acceptance_shift=shift)) == []
    checks = run(DriftDetector(DriftConfig(), H), 100, acceptance_shift=shift)  # the default signal
    assert event_steps(checks) == [60] and checks[1].event.heads == (1,)
    quiet = run(DriftDetector(DriftConfig(), H), 400, seed=3)
    assert event_steps(quiet) == []


def test_cooldown_blocks_a_second_shift_then_lets_it_trigger():
    # Head 0 drifts from step 21 (trigger at 60); the update fixes it for steps 61-69; it drifts
    # again from 70, inside the cooldown (61-110). Checks at 80 and 100 see the drift but count
    # nothing; 120 and 140 are its 2 consecutive degraded checks.
    def shift(step):
        return from_step(21, 0.2)(step) if step <= 60 else from_step(70, 0.2)(step)

    def drop(step):
        return from_step(21, 0.15)(step) if step <= 60 else from_step(70, 0.15)(step)

    checks = {c.step: c for c in run(DriftDetector(TV_RULE, H), 160, shift, drop)}
    assert event_steps(checks.values()) == [60, 140]
    for step in (80, 100):
        assert checks[step].in_cooldown and checks[step].z[0] > 2.5 and not checks[step].degraded.any()
    assert checks[120].streak[0] == 1 and checks[120].event is None


def test_event_names_the_most_degraded_heads():
    # Heads 0, 1, 3 drift with acceptance drops; head 2 drifts most but its acceptance holds.
    tv = torch.tensor([0.1, 0.3, 0.5, 0.2], dtype=torch.float64)
    acceptance = torch.tensor([0.1, 0.1, 0.0, 0.1], dtype=torch.float64)
    checks = run(DriftDetector(TV_RULE, H), 60, lambda s: tv if s > 20 else 0.0,
                 lambda s: acceptance if s > 20 else 0.0)
    event = checks[-1].event
    assert event.step == 60 and event.heads == (1, 3)
    assert event.z[0] > event.z[1] > float(checks[-1].z[0])
    assert float(checks[-1].z[2]) > event.z[0]  # largest z, but not degraded


def test_head_without_enough_records_keeps_its_window_and_streak():
    # 5 records per bucket per step: 500 per 20-step window, below min_records = 1024. The
    # window accumulates to 1500 at check 80 (streak 1), restarts, and is 1500 again at 140.
    checks = {c.step: c for c in run(DriftDetector(TV_RULE, H), 140, from_step(21, 0.2), from_step(21, 0.15),
                                     records=5)}
    assert all(checks[s].z.isnan().all() for s in (40, 60, 100, 120))
    assert checks[80].streak[0] == 1 and checks[80].event is None
    assert checks[100].streak[0] == 1  # held through the skipped checks
    assert checks[140].event is not None and checks[140].event.heads == (0,)


@pytest.mark.parametrize("stop", [10, 70])  # during calibration; inside the cooldown, mid-window
def test_state_round_trips_to_the_same_future_decisions(stop):
    def shift(step):
        return from_step(21, 0.2)(step) if step <= 60 else from_step(65, 0.2, heads=(0, 2))(step)

    def drop(step):
        return from_step(21, 0.15)(step) if step <= 60 else from_step(65, 0.15, heads=(0, 2))(step)

    cfg = TV_RULE
    original = DriftDetector(cfg, H)
    run(original, stop, shift, drop, seed=5)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    resumed = DriftDetector(cfg, H)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    ahead = [run(d, 200 - stop, shift, drop, seed=6) for d in (original, resumed)]
    assert [c.step for c in ahead[0]] == [c.step for c in ahead[1]]
    assert event_steps(ahead[0]) == event_steps(ahead[1]) and event_steps(ahead[0])
    for a, b in zip(*ahead):
        assert a.event == b.event and torch.equal(a.streak, b.streak) and a.in_cooldown == b.in_cooldown
        assert torch.allclose(a.z, b.z, equal_nan=True)
    with pytest.raises(ValueError, match="heads, buckets"):
        DriftDetector(cfg, H + 1).load_state_dict(original.state_dict())


@pytest.mark.parametrize("field, value", [("calibration_steps", 0), ("check_every", 0), ("z_threshold", -1.0),
                                          ("min_acceptance_drop", 1.5), ("consecutive", 0), ("cooldown_steps", -1),
                                          ("max_heads_per_event", 0), ("depth_buckets", (256, 128)),
                                          ("mad_floor", 0.0), ("min_records", 0), ("signal", "entropy")])
def test_config_errors_name_the_dotted_field(field, value):
    with pytest.raises(ValueError, match=rf"rollout\.speculation\.drift\.{field}"):
        DriftConfig(**{field: value})
