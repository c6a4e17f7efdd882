"""Reflex, the fast per-response correction of the drafter (speculation/adaptation/reflex.py): its math by hand,
its state on synthetic feedback, and the engine with it on (greedy unchanged)."""
from __future__ import annotations

import math

import pytest
import torch

from specroll.configs import build_dataclass
from specroll.models import build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.speculation import SpeculationConfig, SpeculativeDecoder
from specroll.speculation.adaptation.maturation import MaturedProposals
from specroll.speculation.adaptation.reflex import (
    FastState,
    Feedback,
    ReflexConfig,
    SafetyGuard,
    matured_feedback,
    record_errors,
    record_gate,
    rms,
)


def test_record_error_and_tv_by_hand():
    lm_head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    # p = [.5 .3 .2]: its top-2 {0: 0.5, 1: 0.3}, and at the sketch's ids the same two.
    p_logp, p_ids, p_at_sketch = torch.tensor([[0.5, 0.3]]).log(), torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.3]]).log()
    head_logp, head_ids = torch.tensor([[0.7, 0.3]]).log(), torch.tensor([[0, 1]])
    drafted = torch.tensor([[0, -1]])  # the tree drafted token 0 only
    # p's top-2 {0: 0.5, 1: 0.3} and q's sketch {0: 0.7, 1: 0.3} share their tokens: coefficients -0.2 and 0.
    error, tv = record_errors(p_logp, p_ids, p_at_sketch, head_logp, head_ids, drafted, lm_head, coverage_weight=0.0)
    torch.testing.assert_close(error, torch.tensor([[-0.2, 0.0]]))
    # TV: 0.5 * (0.2 on the union + |0.2 - 0| outside it) = 0.2, the exact TV of [.5 .3 .2] and [.7 .3 0].
    torch.testing.assert_close(tv, torch.tensor([0.2]))
    # Coverage: token 1 (p = 0.3) was not drafted, so 0.3 * W[1] joins the error.
    error, _ = record_errors(p_logp, p_ids, p_at_sketch, head_logp, head_ids, drafted, lm_head, coverage_weight=1.0)
    torch.testing.assert_close(error, torch.tensor([[-0.2, 0.3]]))


def test_record_gate_by_hand():
    cfg = ReflexConfig()
    gate = record_gate(torch.tensor([0.04, 0.125, 0.2, 0.5]), torch.tensor([1, 1, 2, 3]), cfg)
    torch.testing.assert_close(gate, torch.tensor([0.0, 0.5, 0.85, 0.85**2]))


def feed(fast: FastState, directions: torch.Tensor, cfg: ReflexConfig, emitted: int = 2) -> None:
    rows = directions.shape[0]
    fast.update(Feedback(directions, torch.ones(rows), torch.ones(rows), torch.zeros(rows)),
                torch.full((rows,), emitted), cfg)


@pytest.mark.parametrize("kind", ["noise", "shuffled"])
def test_reliability_stays_closed_on_feedback_that_does_not_predict_the_next(kind):
    cfg, g = ReflexConfig(), torch.Generator().manual_seed(0)
    fast = FastState(16, 32, "cpu")
    drifts = torch.randn(16, 32, generator=g)  # each trajectory's persistent error, as in the test below ...
    drifts -= drifts.mean(dim=0)  # (none shared by all: that part would persist, and rightly open the gate)
    for _ in range(300):
        if kind == "noise":
            f = torch.randn(16, 32, generator=g)
        else:  # ... but every step each row gets some trajectory's feedback, shuffled
            f = drifts[torch.randperm(16, generator=g)] + 0.7 * torch.randn(16, 32, generator=g)
        feed(fast, f, cfg)
    assert fast.reliability.abs().max() < cfg.reliability_threshold
    assert not fast.active(cfg).any()


def test_reliability_opens_on_a_drift_that_persists_within_the_trajectory():
    cfg, g = ReflexConfig(), torch.Generator().manual_seed(0)
    fast = FastState(16, 32, "cpu")
    drift = torch.randn(16, 32, generator=g)  # one persistent error direction per response
    for _ in range(100):
        feed(fast, drift + 0.7 * torch.randn(16, 32, generator=g), cfg)
    assert (fast.reliability > cfg.reliability_threshold).all() and fast.active(cfg).all()
    cosine = torch.nn.functional.cosine_similarity(fast.state, drift, dim=1)
    assert (cosine > 0.8).all()  # the state points where the drafts err
    assert (rms(fast.state) <= cfg.state_clip + 1e-6).all()


def test_blow_up_or_non_finite_feedback_resets_the_state():
    cfg, g = ReflexConfig(), torch.Generator().manual_seed(0)
    fast = FastState(3, 8, "cpu")
    base = torch.randn(3, 8, generator=g)
    for _ in range(20):
        feed(fast, base, cfg)
    f = base.clone()
    f[1] *= 100  # RMS far above its running normalisation
    f[2, 0] = float("nan")
    feed(fast, f, cfg)
    assert rms(fast.state[0]) > 0 and rms(fast.state[1]) == 0 and rms(fast.state[2]) == 0
    assert fast.resets == 2 and torch.isfinite(fast.state).all()


def test_correction_is_at_most_a_hundredth_of_the_head_state_times_scale():
    cfg = ReflexConfig(mode="code", scale=3.0)
    fast = FastState(2, 4, "cpu")
    fast.state = torch.tensor([[1.0, -1.0, 1.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    fast.evidence = torch.tensor([1e6, 1e6])
    head = torch.full((2, 3, 4), 2.0)
    corr = fast.correction(4, head, cfg)
    # scale * (1 - e^-inf) * 1 / 1.25 * 0.01 / sqrt(4) * rms(h) = 3 * 0.8 * 0.005 * 2 = 0.024 per unit of s / rms(s)
    torch.testing.assert_close(corr[0], torch.tensor([0.024, -0.024, 0.024, -0.024]).expand(3, 4))
    assert (corr[1] == 0).all()  # a row without state gets nothing


def test_guard_switches_injection_off_after_bad_rollouts_then_back_on():
    cfg = ReflexConfig(guard_baseline_rollouts=3, guard_bad_in_a_row=2, guard_off_rollouts=4)
    guard = SafetyGuard(cfg)
    for _ in range(3):
        guard.end_rollout(2.0)
    assert guard.baseline == pytest.approx(2.0)
    guard.end_rollout(1.8)  # below 0.95 x 2.0: bad
    guard.end_rollout(1.95)  # fine: the run of bad ones restarts
    guard.end_rollout(1.8)
    assert guard.allows
    guard.end_rollout(1.8)
    assert not guard.allows and guard.trips == 1
    for _ in range(4):
        guard.end_rollout(1.0)
    assert guard.allows


def test_config_names_the_field():
    with pytest.raises(ValueError, match=r"^half_life_tokens must be a finite number > 0, got 0$"):
        ReflexConfig(half_life_tokens=0)
    with pytest.raises(ValueError, match=r"^adaptation must be one of 'static', .*, got 'sometimes'$"):
        SpeculationConfig(adaptation="sometimes")
    with pytest.raises(ValueError, match=r"^rollout\.speculation\.reflex\.half_life_tokens must be a finite number > 0"):
        build_dataclass(SpeculationConfig, {"reflex": {"half_life_tokens": 0}}, "rollout.speculation")


def test_greedy_output_is_unchanged_by_reflex_and_drafts_change():
    model = build_tiny_model(vocab_size=64, init_std=0.1, seed=3).requires_grad_(False)
    prompts, params = [[3, 4, 5], [6, 7], [9, 1, 2, 8]], SamplingParams(temperature=0, max_new_tokens=40, n=2)
    outs = {}
    for adaptation in ("static", "reflex"):
        cfg = SpeculationConfig(heads_path=None, budget="fixed", fixed_nodes=8, adaptation=adaptation,
                         reflex=ReflexConfig(mode="code", scale=300.0))
        outs[adaptation] = RolloutEngine(model, decoder=SpeculativeDecoder(model, cfg)).generate(prompts, params)
    assert outs["reflex"].token_ids == outs["static"].token_ids == RolloutEngine(model).generate(prompts, params).token_ids
    tree = outs["reflex"].stats.tree
    assert tree.reflex.on_share > 0.5 and tree.reflex.records > 0
    assert tree.tokens_per_step_hist != outs["static"].stats.tree.tokens_per_step_hist  # the correction moved drafts


def test_feedback_reads_the_target_on_the_draft_vocabulary_alone():
    """matured_feedback over a draft vocabulary (unsorted ids) equals the errors and TVs computed
    from the full target rows with -inf outside the vocabulary, renormalised."""
    g = torch.Generator().manual_seed(0)
    vocab_size, hidden, m = 64, 8, 4
    target_logp = torch.log_softmax(torch.randn(3, 5, vocab_size, generator=g) * 3, dim=-1)
    target_logp[2, 1, 10:] = float("-inf")  # top-k left this node a few tokens, maybe none of the vocabulary
    draft_vocab = torch.randperm(vocab_size, generator=g)[:24]
    row, node = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([0, 2, 4, 1, 3])
    head_ids = draft_vocab[torch.stack([torch.randperm(24, generator=g)[:m] for _ in row])]
    head_logp = torch.log_softmax(torch.randn(len(row), m, generator=g), dim=-1) - 0.5
    children = torch.cat((head_ids[:, :2], torch.full((len(row), 1), -1)), dim=1)
    matured = MaturedProposals(row=row, depth=torch.tensor([0, 1, 0, 0, 2]), node=node, head_logp=head_logp,
                               head_ids=head_ids, children=children)
    lm_head = torch.randn(vocab_size, hidden, generator=g)
    cfg = ReflexConfig(sketch_size=6, tv_floor=0.0)
    feedback = matured_feedback(matured, target_logp, lm_head, cfg, draft_vocab)
    at_nodes = target_logp[row, node]
    padded = torch.full_like(at_nodes, float("-inf")).index_copy(-1, draft_vocab, at_nodes[:, draft_vocab])
    full = torch.log_softmax(padded, dim=-1).nan_to_num(nan=float("-inf"))
    p_logp, p_ids = full.topk(6, dim=-1)
    error, tv = record_errors(p_logp, p_ids, full.gather(1, head_ids), head_logp, head_ids, children, lm_head, 1.0)
    gate = record_gate(tv, matured.depth + 1, cfg)
    direction = torch.zeros(3, hidden).index_add_(0, row, gate[:, None] * error)
    mass = torch.zeros(3).index_add_(0, row, gate)
    torch.testing.assert_close(feedback.tv_sum, torch.zeros(3).index_add_(0, row, tv))
    torch.testing.assert_close(feedback.direction, direction / mass.clamp(min=1e-12)[:, None])
