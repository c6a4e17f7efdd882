"""KL estimators on hand-worked log-probabilities."""

import math

import pytest
import torch

from specroll.grpo import kl_estimate

LN2 = math.log(2)


def _logp(p: float) -> torch.Tensor:
    return torch.tensor([math.log(p)], dtype=torch.float64)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        # logp - ref = ln 0.5 - ln 0.25 = ln 2 ~ 0.693147
        ("k1", LN2),
        # 0.5 * (ln 2)^2 ~ 0.240227
        ("k2", 0.5 * LN2**2),
        # d = ref - logp = -ln 2: exp(d) - d - 1 = 0.5 + ln 2 - 1 ~ 0.193147
        ("k3", LN2 - 0.5),
    ],
)
def test_policy_more_likely_than_reference(estimator, expected):
    kl = kl_estimate(_logp(0.5), _logp(0.25), estimator)
    torch.testing.assert_close(kl, torch.tensor([expected], dtype=torch.float64))


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        # ln 0.25 - ln 0.5 = -ln 2: k1 can be negative
        ("k1", -LN2),
        ("k2", 0.5 * LN2**2),
        # d = ln 2: exp(d) - d - 1 = 2 - ln 2 - 1 ~ 0.306853
        ("k3", 1 - LN2),
    ],
)
def test_policy_less_likely_than_reference(estimator, expected):
    kl = kl_estimate(_logp(0.25), _logp(0.5), estimator)
    torch.testing.assert_close(kl, torch.tensor([expected], dtype=torch.float64))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_identical_policies_give_zero(estimator):
    logp = torch.log(torch.tensor([0.1, 0.5, 0.9]))
    assert torch.equal(kl_estimate(logp, logp, estimator), torch.zeros(3))


def test_k3_is_the_default():
    torch.testing.assert_close(
        kl_estimate(_logp(0.5), _logp(0.25)), kl_estimate(_logp(0.5), _logp(0.25), "k3")
    )


def test_clamp_keeps_k3_finite_in_float32():
    # d = ref - logp = 1000 overflows exp in float32; clamped to 20: exp(20) - 20 - 1.
    logp, ref = torch.tensor([-1000.0]), torch.tensor([0.0])
    assert torch.isinf(kl_estimate(logp, ref, "k3")).all()
    clamped = kl_estimate(logp, ref, "k3", log_ratio_clamp=20.0)
    torch.testing.assert_close(clamped, torch.tensor([math.exp(20) - 21]))


def test_unknown_estimator_rejected():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(_logp(0.5), _logp(0.25), "k4")
