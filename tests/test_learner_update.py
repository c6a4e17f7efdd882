"""GRPOLearner on real DeepSpeed (CPU, gloo): accumulation exactness, ZeRO stages, metrics, errors."""

import pytest
import torch

from specroll.grpo import PolicyLossConfig, policy_loss
from specroll.learner import GRPOLearner, GRPOSamples, LearnerConfig, micro_batch_indices, pad_samples, sequence_logprobs
from specroll.models import build_tiny_model
from specroll.telemetry.metric_names import check_metric_name

LR = 1e-2
# A large Adam epsilon makes the first step lr * g / (|g| + eps), proportional to the gradient
# for small g: a mis-scaled accumulation would show in the weights, not be normalised away.
ADAM_EPS = 1.0
SMALL_BUDGET = 12  # tokens per micro-batch: splits the batch below into several micro-batches


def random_samples(n: int = 6, seed: int = 0) -> GRPOSamples:
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    prompts = [torch.randint(2, 64, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist() for _ in range(n)]
    responses = [torch.randint(2, 64, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist() for _ in range(n)]
    return GRPOSamples(prompts, responses, torch.randn(n, generator=gen))


def with_old_logprobs(samples: GRPOSamples, noise: float, seed: int = 1) -> GRPOSamples:
    """Old log-probs of the initial model plus noise, so ratios spread over and past the clip range."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    model = build_tiny_model()
    mb = pad_samples(samples, list(range(len(samples))))
    with torch.no_grad():
        logp = sequence_logprobs(model, mb.input_ids, mb.prompt_lens, mb.response_lens).logprobs
    samples.old_logprobs = [logp[i, : len(r)] + noise * torch.randn(len(r), generator=gen) for i, r in enumerate(samples.response_ids)]
    return samples


def oracle_first_step(samples: GRPOSamples, loss_cfg: PolicyLossConfig, model_type: str = "llama"):
    """Plain autograd on the whole batch, then the first AdamW step written out by hand."""
    model = build_tiny_model(model_type)
    mb = pad_samples(samples, list(range(len(samples))), samples.old_logprobs)
    out = sequence_logprobs(model, mb.input_ids, mb.prompt_lens, mb.response_lens, with_entropy=True)
    loss, _ = policy_loss(out.logprobs, mb.old_logprobs, mb.advantages, out.mask, loss_cfg, truncated=mb.truncated,
                          logp_sampler=mb.sampler_logprobs, entropy=out.entropy)
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    with torch.no_grad():
        expected = {name: p - LR * p.grad / (p.grad.abs() + ADAM_EPS) for name, p in model.named_parameters()}
    return loss.item(), grad_norm.item(), expected


def learner_for(zero_stage: int, model_type: str = "llama", **overrides) -> GRPOLearner:
    fields = dict(zero_stage=zero_stage, lr=LR, adam_eps=ADAM_EPS, grad_clip=0.0, device=str(torch.get_default_device()), max_response_len=16, max_seq_len=32)
    fields.update(overrides)
    return GRPOLearner(build_tiny_model(model_type), LearnerConfig(**fields))


@pytest.mark.parametrize(
    "zero_stage, budget, aggregation, model_type",
    [
        (0, 10_000, "token-mean", "llama"),
        (0, SMALL_BUDGET, "token-mean", "llama"),
        (2, SMALL_BUDGET, "token-mean", "llama"),
        (3, SMALL_BUDGET, "token-mean", "llama"),
        (0, SMALL_BUDGET, "seq-mean-token-mean", "llama"),
        (3, SMALL_BUDGET, "token-mean", "qwen3"),  # query and key norms partitioned and gathered too
    ],
)
def test_micro_batches_accumulate_to_the_full_batch_step(zero_stage, budget, aggregation, model_type):
    samples = with_old_logprobs(random_samples(), noise=0.3)
    loss_cfg = PolicyLossConfig(aggregation=aggregation)
    num_micro = len(micro_batch_indices(samples.sequence_lengths(), list(range(len(samples))), budget))
    assert num_micro == 1 if budget > 1000 else num_micro >= 3
    expected_loss, expected_norm, expected = oracle_first_step(samples, loss_cfg, model_type)

    learner = learner_for(zero_stage, model_type, micro_batch_tokens=budget, loss=loss_cfg)
    metrics = learner.update(samples)
    version, weights = learner.policy_state_dict()

    assert version == 1 and metrics["train/optimizer_steps"] == 1
    assert metrics["train/loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(expected_norm, rel=1e-4)
    initial = build_tiny_model(model_type).state_dict()
    assert weights.keys() == initial.keys()
    largest_move = 0.0
    for name, want in expected.items():
        torch.testing.assert_close(weights[name] - initial[name], want - initial[name], rtol=1e-4, atol=1e-8)
        largest_move = max(largest_move, float((want - initial[name]).abs().max()))
    assert largest_move > 1e-4


@pytest.mark.parametrize(
    "budget, loss_fields, metric",
    [
        (SMALL_BUDGET, {"importance_sampling_level": "sequence", "clip_low": 0.02, "clip_high": 0.02}, "train/clip_frac_low"),
        (SMALL_BUDGET, {"surrogate": "cispo", "cispo_weight_max": 1.2}, "train/cispo_clip_frac"),
        (SMALL_BUDGET, {"mismatch_correction": "token_truncate", "mismatch_weight_max": 1.5}, "train/is_clipped_frac"),
        (SMALL_BUDGET, {"mismatch_correction": "sequence_mask", "mismatch_weight_max": 2.0}, "train/is_weight_mean"),
        # The entropy selection is made within each micro-batch: one here, as in the oracle.
        (10_000, {"top_entropy_quantile": 0.3}, "train/entropy_mask_frac"),
    ],
)
def test_loss_variants_step_equals_the_whole_batch_oracle(budget, loss_fields, metric):
    samples = with_old_logprobs(random_samples(), noise=0.3)
    gen = torch.Generator().manual_seed(2)
    samples.sampler_logprobs = [old + 0.5 * torch.randn(old.shape, generator=gen) for old in samples.old_logprobs]
    loss_cfg = PolicyLossConfig(**loss_fields)
    expected_loss, expected_norm, expected = oracle_first_step(samples, loss_cfg)
    metrics = learner_for(0, micro_batch_tokens=budget, loss=loss_cfg).update(samples)
    assert metrics["train/loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(expected_norm, rel=1e-4)
    assert 0 < metrics[metric] < 5
    check_metric_name(metric)


def test_mismatch_correction_needs_the_rollouts_sampling_logprobs():
    learner = learner_for(0, loss={"mismatch_correction": "token_mask"})
    base = random_samples(n=4)
    with pytest.raises(ValueError, match="sampler_logprobs"):
        learner.build_samples(base.prompt_ids, base.response_ids, [1.0, 0.0, 1.0, 0.0], group_size=2)
    with pytest.raises(ValueError, match="sampler_logprobs"):
        learner.update(base)
    sampled = [[-1.0] * len(r) for r in base.response_ids]
    samples = learner.build_samples(base.prompt_ids, base.response_ids, [1.0, 0.0, 1.0, 0.0], group_size=2,
                                    sampler_logprobs=sampled)
    assert [s.tolist() for s in samples.sampler_logprobs] == sampled
    # Without the correction the sampling log-probs are not kept.
    plain = learner_for(0).build_samples(base.prompt_ids, base.response_ids, [1.0, 0.0, 1.0, 0.0], group_size=2,
                                         sampler_logprobs=sampled)
    assert plain.sampler_logprobs is None


def test_soft_overlong_penalty_shapes_the_advantages():
    # Responses of 4 and 8 tokens with equal task rewards; L_max = 8, L_cache = 4: penalties 0 and -1,
    # so the short one gets the positive advantage (sample std of [0, -1] is 0.7071).
    learner = learner_for(0, overlong_max_len=8, overlong_buffer_len=4)
    samples = learner.build_samples([[1], [1]], [[5] * 4, [5] * 8], [1.0, 1.0], group_size=2)
    torch.testing.assert_close(samples.advantages, torch.tensor([0.7071, -0.7071]), atol=1e-4, rtol=0)
    assert learner.update(samples)["train/overlong_penalty_mean"] == -0.5
    with pytest.raises(ValueError, match="overlong_max_len"):
        LearnerConfig(overlong_buffer_len=4)


@pytest.mark.parametrize("zero_stage, dtype", [(0, "float32"), (2, "float32"), (2, "bfloat16")])
def test_updates_move_the_policy_towards_high_advantage_responses(zero_stage, dtype):
    samples = random_samples(n=8, seed=3)
    learner = learner_for(zero_stage, dtype=dtype, lr=2e-3, adam_eps=1e-8, micro_batch_tokens=24)
    before = learner.compute_logprobs(samples)
    samples.old_logprobs = before
    losses = [learner.update(samples)["train/loss"] for _ in range(4)]
    after = learner.compute_logprobs(samples)
    # The surrogate on the fixed training batch goes down ...
    assert losses[-1] < losses[0] - 0.05
    if dtype == "float32":
        assert all(b < a for a, b in zip(losses, losses[1:]))
    # ... because log-probs rise where the advantage is positive and fall where it is negative.
    change = torch.stack([(a - b).sum() for a, b in zip(after, before)])
    assert float((samples.advantages * change).sum()) > 0
    assert learner.policy_state_dict()[0] == 4


def test_metrics_mini_batches_and_version():
    learner = learner_for(0, lr=1e-3, adam_eps=1e-8, mini_batch_size=3, ppo_epochs=2, micro_batch_tokens=16)
    base = random_samples(n=8, seed=5)
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    samples = learner.build_samples(base.prompt_ids, base.response_ids, rewards, group_size=2, truncated=[False] * 7 + [True])
    metrics = learner.update(samples)
    # 8 samples in mini-batches of 3 -> 3 optimizer steps per epoch, 2 epochs.
    assert metrics["train/optimizer_steps"] == 6 and learner.policy_state_dict()[0] == 6
    assert metrics["train/policy_version"] == 6
    assert metrics["train/frac_zero_std_groups"] == 0.5  # groups (1, 1) and (0, 0)
    assert metrics["train/num_sequences"] == 8
    assert metrics["train/truncated_frac"] == 0.125
    assert metrics["train/response_tokens"] == sum(len(r) for r in base.response_ids)
    assert metrics["train/lr"] == pytest.approx(1e-3)
    assert 0 <= metrics["train/padding_frac"] < 1
    # Second epoch is off-policy: the ratio moved away from 1.
    assert metrics["train/approx_kl"] > 0
    for key in ("train/loss", "train/pg_loss", "train/clip_frac_low", "train/clip_frac_high", "train/entropy", "train/grad_norm"):
        assert key in metrics
    assert "train/kl_ref" not in metrics
    for name in metrics:
        check_metric_name(name)


def test_reference_model_gives_a_kl_that_starts_at_zero():
    learner = learner_for(2, lr=1e-2, adam_eps=1e-8, use_reference=True, loss={"kl_coef": 0.05})
    samples = random_samples(n=6, seed=7)
    initial = learner.compute_logprobs(samples)
    first = learner.update(samples)
    second = learner.update(samples)
    assert first["train/kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert second["train/kl_ref"] > 1e-5
    # The reference stays frozen at the initial policy while the policy moves.
    for ref, init, now in zip(learner.compute_logprobs(samples, use_reference=True), initial, learner.compute_logprobs(samples)):
        torch.testing.assert_close(ref, init)
        assert not torch.allclose(now, init)


def test_fully_masked_mini_batch_takes_no_step():
    learner = learner_for(0, loss={"mask_truncated": True})
    samples = random_samples(n=4)
    samples.truncated = torch.ones(4, dtype=torch.bool)
    metrics = learner.update(samples)
    assert metrics["train/skipped_steps"] == 1 and metrics["train/optimizer_steps"] == 0
    assert learner.policy_state_dict()[0] == 0


def test_bad_batches_raise_clear_errors():
    learner = learner_for(0)
    with pytest.raises(ValueError, match="empty batch"):
        learner.update(GRPOSamples([], [], torch.zeros(0)))
    samples = random_samples(n=4)
    samples.response_ids[2] = [5] * 17
    with pytest.raises(ValueError, match="sample 2: response has 17 tokens, more than max_response_len=16"):
        learner.update(samples)
    with pytest.raises(ValueError, match="no reference model"):
        learner.compute_logprobs(random_samples(n=2), use_reference=True)
    assert learner.policy_state_dict()[0] == 0


class ForwardCounter:
    """Counts the policy's forwards with and without autograd (a hook on the real module)."""

    def __init__(self, learner: GRPOLearner) -> None:
        self.with_grad = self.without_grad = 0
        learner.module.register_forward_hook(self.count)

    def count(self, module, inputs, output) -> None:
        if torch.is_grad_enabled():
            self.with_grad += 1
        else:
            self.without_grad += 1


TRAIN_METRICS = ("train/loss", "train/pg_loss", "train/grad_norm", "train/approx_kl", "train/entropy",
                 "train/clip_frac_low", "train/clip_frac_high", "train/optimizer_steps")


@pytest.mark.parametrize("zero_stage, budget", [(0, 10_000), (0, SMALL_BUDGET), (2, SMALL_BUDGET)])
def test_one_epoch_of_one_mini_batch_takes_old_logprobs_from_the_update_forward(zero_stage, budget):
    settings = dict(lr=1e-2, adam_eps=1e-8, micro_batch_tokens=budget)
    samples = random_samples(n=6, seed=11)
    num_micro = len(micro_batch_indices(samples.sequence_lengths(), list(range(len(samples))), budget))
    # Two-pass: the old log-probs scored first, as before.
    two_pass = learner_for(zero_stage, **settings)
    samples.old_logprobs = two_pass.compute_logprobs(samples)
    expected = [two_pass.update(samples)]
    samples.old_logprobs = two_pass.compute_logprobs(samples)
    expected.append(two_pass.update(samples))

    one_pass = learner_for(zero_stage, **settings)
    assert one_pass.old_logprobs_from_update(len(samples))
    forwards = ForwardCounter(one_pass)
    samples.old_logprobs = None
    got = [one_pass.update(samples), one_pass.update(samples)]

    assert (forwards.with_grad, forwards.without_grad) == (2 * num_micro, 0)
    for want, have in zip(expected, got):
        assert have["train/approx_kl"] == 0.0 and have["train/clip_frac_high"] == 0.0
        for key in TRAIN_METRICS:
            assert have[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    moved = two_pass.policy_state_dict()[1]
    for name, weight in one_pass.policy_state_dict()[1].items():
        torch.testing.assert_close(weight, moved[name], rtol=1e-6, atol=1e-9)
    assert not torch.equal(moved["lm_head.weight"], build_tiny_model().state_dict()["lm_head.weight"])


@pytest.mark.parametrize("overrides", [{"ppo_epochs": 2}, {"mini_batch_size": 3}])
def test_several_epochs_or_mini_batches_score_old_logprobs_in_a_separate_pass(overrides):
    settings = dict(lr=1e-2, adam_eps=1e-8, micro_batch_tokens=10_000, **overrides)
    samples = random_samples(n=6, seed=11)
    learner = learner_for(0, **settings)
    assert not learner.old_logprobs_from_update(len(samples))
    forwards = ForwardCounter(learner)
    metrics = learner.update(samples)
    steps = int(metrics["train/optimizer_steps"])
    assert (forwards.with_grad, forwards.without_grad) == (steps, 1)
    # Later steps see a moved policy, so their ratios leave 1: the old log-probs were kept fixed.
    assert metrics["train/approx_kl"] > 0

    reference = learner_for(0, **settings)
    samples.old_logprobs = reference.compute_logprobs(samples)
    want = reference.update(samples)
    for key in TRAIN_METRICS:
        assert metrics[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key


def test_a_mini_batch_as_large_as_the_batch_is_one_mini_batch():
    learner = learner_for(0, mini_batch_size=6)
    assert learner.old_logprobs_from_update(6) and not learner.old_logprobs_from_update(7)
