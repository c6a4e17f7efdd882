"""End-to-end GRPO learns: rollouts from the rollout engine, rewards, DeepSpeed updates, weight sync.

Task: reward 1 when a response's first token is a target token whose initial probability is
5-20%. A working loop (advantages, log-probs, loss sign, accumulation, weight publishing)
drives it above 0.8 within a fixed number of steps; any sign or masking bug keeps it near chance.
GRPO's clipped loss, GSPO's (the `learner/loss=gspo` preset) and CISPO's with the mismatch
correction on the rollout's log-probs each get there.
"""

import pytest
import torch

from specroll.learner import GRPOLearner, LearnerConfig
from specroll.models import CausalLM, build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams

NUM_PROMPTS, GROUP_SIZE, OPTIMIZER_STEPS = 8, 8, 60
LOSSES = {
    "grpo": {},
    "gspo": {"importance_sampling_level": "sequence", "clip_low": 3e-4, "clip_high": 4e-4,
             "aggregation": "seq-mean-token-mean"},
    "cispo-mismatch": {"surrogate": "cispo", "mismatch_correction": "token_truncate"},
}
# Mini-batches (optimizer steps) per update. GSPO's clip range (4e-4 of a sequence's ratio) stops
# every step after an update's first, so the prompts of a second mini-batch would go unlearned.
MINI_BATCHES = {"grpo": 2, "gspo": 1, "cispo-mismatch": 2}


def target_chance(model: CausalLM, prompts: torch.Tensor, target: int) -> float:
    """Exact mean over prompts of p(first response token = target)."""
    with torch.no_grad():
        return float(model(prompts).logits[:, -1].softmax(-1)[:, target].mean())


@pytest.mark.learning
@pytest.mark.timeout(600)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_grpo_learns_to_start_with_the_rewarded_token(loss):
    prompts = torch.randint(2, 64, (NUM_PROMPTS, 4), generator=torch.Generator().manual_seed(0))
    # A larger init scale gives a peaked distribution, so some token has a chance of 5-20%.
    policy = build_tiny_model(init_std=0.3)
    with torch.no_grad():
        chances = policy(prompts).logits[:, -1].softmax(-1).mean(0)
    chances[policy.config.eos_token_ids] = 0.0
    target = int((chances - 0.08).abs().argmin())
    initial = target_chance(policy, prompts, target)
    assert 0.05 <= initial <= 0.2

    learner = GRPOLearner(
        policy,
        LearnerConfig(lr=1e-2, mini_batch_size=NUM_PROMPTS * GROUP_SIZE // MINI_BATCHES[loss], micro_batch_tokens=64,
                      max_response_len=4, max_seq_len=16, device="cpu", loss=LOSSES[loss]),
    )
    rollout_model = CausalLM(policy.config)
    params = dict(temperature=1.0, max_new_tokens=3, n=GROUP_SIZE)
    prompt_lists = prompts.tolist()
    mean_rewards = []
    for step in range(OPTIMIZER_STEPS // MINI_BATCHES[loss]):
        version, weights = learner.policy_state_dict()
        assert version == MINI_BATCHES[loss] * step
        rollout_model.load_state_dict(weights)
        out = RolloutEngine(rollout_model).generate(prompt_lists, SamplingParams(seed=step, **params))
        rewards = [float(tokens[0] == target) for tokens in out.token_ids]
        mean_rewards.append(sum(rewards) / len(rewards))
        samples = learner.build_samples(
            [p for p in prompt_lists for _ in range(GROUP_SIZE)],
            out.token_ids,
            rewards,
            group_size=GROUP_SIZE,
            truncated=[reason == "length" for reason in out.finish_reasons],
            sampler_logprobs=out.logprobs,
        )
        metrics = learner.update(samples)
        assert metrics["train/optimizer_steps"] == MINI_BATCHES[loss]

    assert mean_rewards[0] < 0.25
    assert sum(mean_rewards[-3:]) / 3 > 0.8, mean_rewards
    assert target_chance(learner.module, prompts, target) > 0.8
