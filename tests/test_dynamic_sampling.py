"""DAPO's dynamic sampling, by hand-worked cases: which groups carry a reward signal, what a step
does after each sampling round (sample more, train, or skip at the cap), and how rounds fill a batch."""
import math

import pytest

from specroll.actors import Rollouts
from specroll.configs import DynamicSamplingConfig
from specroll.data import Problem, PromptStream
from specroll.dynamic_sampling import RoundOutcome, decide, fill_batch, groups_with_signal
from specroll.telemetry import metric_names as m


def test_a_group_has_signal_when_two_of_its_rewards_differ():
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.0, math.nan, math.nan]
    assert groups_with_signal(rewards, 2) == [False, True, False, True, True]  # NaN differs from all
    assert groups_with_signal([0.0, 0.0, 0.0, 1.0], 4) == [True]
    with pytest.raises(ValueError, match="5 rewards do not form groups of 2"):
        groups_with_signal([0.0] * 5, 2)


@pytest.mark.parametrize("kept, rounds_done, cfg, ranks, expected", [
    (4, 0, DynamicSamplingConfig(enabled=True), 1, RoundOutcome(0, 4, False)),  # full at once
    (6, 1, DynamicSamplingConfig(enabled=True), 1, RoundOutcome(0, 4, False)),  # the first 4 of 6
    (1, 0, DynamicSamplingConfig(enabled=True), 1, RoundOutcome(3, 0, False)),  # as many as missing
    (1, 3, DynamicSamplingConfig(enabled=True, round_prompts=8, max_extra_rounds=4), 1, RoundOutcome(8, 0, False)),
    (3, 4, DynamicSamplingConfig(enabled=True), 2, RoundOutcome(0, 2, False)),  # at the cap: what two ranks share
    (1, 4, DynamicSamplingConfig(enabled=True), 2, RoundOutcome(0, 0, True)),  # ... none: skipped
    (3, 0, DynamicSamplingConfig(enabled=True, max_extra_rounds=0, at_cap="skip"), 1, RoundOutcome(0, 0, True)),
])
def test_after_a_round_a_step_samples_more_trains_or_skips(kept, rounds_done, cfg, ranks, expected):
    assert decide(kept, 4, rounds_done, cfg, ranks) == expected


def rollouts(first_index, rewards, group_size=2, gen_s=1.0):
    """Rollouts of consecutive prompts with the given rewards (responses name their prompt)."""
    prompts = range(first_index, first_index + len(rewards) // group_size)
    return Rollouts(step=3, group_size=group_size, policy_version=5, head_version=None, prompt_indices=list(prompts),
                    prompt_ids=[[p] for p in prompts], response_ids=[[p] for p in prompts for _ in range(group_size)],
                    logprobs=[[-1.0] for _ in rewards], finish_reasons=["stop"] * len(rewards), rewards=list(rewards),
                    correct=[r > 0 for r in rewards], gen_s=gen_s, reward_s=0.5)


def test_rounds_fill_the_batch_with_the_first_groups_with_signal_in_draw_order():
    """Target 3: round 0 keeps prompt 1 of 0-2; round 1 draws 2 more (3, 4) and keeps 4; round 2
    draws 1 (5), which has none; round 3 draws 1 (6) and fills the batch."""
    extra = {3: [0, 0, 1, 0], 5: [1, 1], 6: [0, 1]}
    calls = []

    def sample(first_index, count):
        calls.append((first_index, count))
        return rollouts(first_index, extra[first_index], gen_s=2.0)

    cfg = DynamicSamplingConfig(enabled=True, target_groups=3)
    filled = fill_batch(rollouts(0, [0, 0, 1, 0, 1, 1]), 3, cfg, 1, sample, iter(range(100)).__next__)
    assert calls == [(3, 2), (5, 1), (6, 1)]
    assert filled.rollouts.prompt_indices == [1, 4, 6] and not filled.skip
    assert filled.rollouts.rewards == [1, 0, 1, 0, 0, 1]
    assert filled.rollouts.gen_s == 1.0 and filled.rollouts.reward_s == 0.5  # the first round's: extra ones are resample time
    assert filled.metrics == {m.RESAMPLE_ROUNDS: 3.0, m.RESAMPLED_GROUPS: 4.0, m.KEPT_GROUPS: 3.0,
                              m.DROPPED_GROUPS: 4.0, m.STEP_SKIPPED: 0.0, m.TIME_RESAMPLE: 1.0}


def test_at_the_cap_a_step_trains_on_the_groups_its_learner_ranks_share():
    cfg = DynamicSamplingConfig(enabled=True, max_extra_rounds=1)
    filled = fill_batch(rollouts(0, [0, 1, 0, 0, 1, 0]), 4, cfg, 2, lambda first, count: rollouts(first, [1, 0, 1, 1]),
                        iter(range(100)).__next__)
    assert not filled.skip and filled.rollouts.prompt_indices == [0, 2]  # 3 kept, 2 ranks: the first 2
    assert filled.metrics[m.KEPT_GROUPS] == 2.0 and filled.metrics[m.DROPPED_GROUPS] == 3.0


def test_at_the_cap_a_skipped_step_keeps_every_group_drawn_for_its_log():
    cfg = DynamicSamplingConfig(enabled=True, max_extra_rounds=1, at_cap="skip")
    filled = fill_batch(rollouts(0, [0, 0, 1, 0]), 2, cfg, 1, lambda first, count: rollouts(first, [1, 1]),
                        iter(range(100)).__next__)
    assert filled.skip and filled.rollouts.prompt_indices == [0, 1, 2]
    assert filled.metrics[m.KEPT_GROUPS] == 0.0 and filled.metrics[m.DROPPED_GROUPS] == 3.0
    assert filled.metrics[m.STEP_SKIPPED] == 1.0


def test_extra_draws_continue_the_prompt_stream_and_its_saved_position():
    problems = [Problem(str(i), str(i), str(i)) for i in range(5)]
    stream = PromptStream(problems, 2, seed=0)
    drawn = [*next(stream), *stream.take(3), *stream.take(1)]
    resumed = PromptStream(problems, 2, seed=0)
    resumed.load_state_dict(stream.state_dict())
    again = PromptStream(problems, 2, seed=0)
    assert drawn + next(resumed) == [*again.take(6), *next(again)]
    assert sorted(p.question for p in drawn[:5]) == ["0", "1", "2", "3", "4"]  # one epoch, in its order
