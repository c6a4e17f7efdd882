"""Evaluating a policy on held-out problems: greedy accuracy, and pass@k over sampled responses.

The same functions serve training (`eval_every`, in the rollout actors) and `python -m
specroll.eval`: problems go to the engine in fixed batches of `eval.batch_size`, each problem's
random stream is named by its index in the held-out set, so the same weights give the same
responses in both, whichever actor runs a batch.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from specroll.configs import EvalConfig, RolloutConfig
from specroll.data import Problem, RewardConfig, format_prompt, score_responses
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.storage import write_atomically
from specroll.telemetry import metric_names as m

from .pass_at_k import pass_at_k

EVAL_STREAM = "eval"  # names the held-out problems' random streams apart from the training prompts'


class EvalPlan(NamedTuple):
    """How responses are drawn: one greedy response per problem, and optionally sampled ones for pass@k."""

    greedy: SamplingParams
    sampled: SamplingParams | None  # None: greedy accuracy only
    ks: tuple[int, ...]  # pass@k reported for each k; empty without samples


def eval_plan(rollout: RolloutConfig, held_out: EvalConfig) -> EvalPlan:
    """Greedy up to `rollout.max_new_tokens`; `held_out.samples` samples at the rollout's temperature, top-p,
    top-k, with its sampler."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=rollout.max_new_tokens, n=1, seed=held_out.seed)
    if not held_out.samples:
        return EvalPlan(greedy, None, ())
    sampled = SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                             max_new_tokens=rollout.max_new_tokens, n=held_out.samples, seed=held_out.seed,
                             sampler=rollout.sampler)
    return EvalPlan(greedy, sampled, tuple(sorted(set(held_out.k))))


class ProblemEval(NamedTuple):
    """One held-out problem's result."""

    index: int  # in the held-out set
    response: str  # the greedy response, decoded
    response_tokens: list[int]  # the greedy response's token ids
    correct: bool  # whether the greedy response's final answer is right
    reward: float  # the greedy response's reward (the problem set's reward function)
    samples: int  # responses sampled for pass@k (0 without)
    samples_correct: int  # of them, those with the right final answer


def batches(problems: list[Problem], size: int) -> list[list[tuple[int, Problem]]]:
    """The held-out problems with their indices, in consecutive batches of `size` (the last may be smaller)."""
    indexed = list(enumerate(problems))
    return [indexed[i:i + size] for i in range(0, len(indexed), size)]


def evaluate_problems(engine: RolloutEngine, tokenizer, problems: list[tuple[int, Problem]], instruction: str,
                      reward: RewardConfig, plan: EvalPlan) -> list[ProblemEval]:
    """Greedy (and sampled) responses to one batch of `(index, problem)`, scored by `reward`."""
    prompts = [format_prompt(tokenizer, problem.question, instruction) for _, problem in problems]
    keys = [(EVAL_STREAM, index) for index, _ in problems]
    golds = [problem.answer for _, problem in problems]
    greedy = engine.generate(prompts, plan.greedy, prompt_keys=keys)
    texts = tokenizer.batch_decode(greedy.token_ids, skip_special_tokens=True)
    scores = score_responses(texts, golds, reward)
    samples, correct = 0, [0] * len(problems)
    if plan.sampled is not None:
        samples = plan.sampled.n
        sampled = engine.generate(prompts, plan.sampled, prompt_keys=keys)
        sampled_texts = tokenizer.batch_decode(sampled.token_ids, skip_special_tokens=True)
        sampled_scores = score_responses(sampled_texts, [g for g in golds for _ in range(samples)], reward)
        for row, score in enumerate(sampled_scores):
            correct[row // samples] += score.correct
    engine.decoder.pop_head_records()  # evaluation responses are no training data for the heads (`RolloutDecoder`)
    return [ProblemEval(index, text, list(tokens), score.correct, score.reward, samples, c)
            for (index, _), text, tokens, score, c in zip(problems, texts, greedy.token_ids, scores, correct)]


@dataclass(frozen=True)
class EvalReport:
    """The results of one evaluation, and where they came from."""

    source: str  # what was evaluated: a checkpoint, a model directory or name
    step: int | None  # training steps behind the policy (a checkpoint's, or the run's when evaluated in training)
    problems: list[ProblemEval]
    ks: tuple[int, ...]

    @property
    def accuracy(self) -> float:
        return sum(p.correct for p in self.problems) / len(self.problems)

    @property
    def reward_mean(self) -> float:
        return sum(p.reward for p in self.problems) / len(self.problems)

    def pass_at(self, k: int) -> float:
        """Mean over problems of the unbiased pass@k of their sampled responses."""
        return sum(pass_at_k(p.samples, p.samples_correct, k) for p in self.problems) / len(self.problems)

    def metrics(self) -> dict[str, float]:
        """`eval/*` (metric_names.py)."""
        out = {
            m.EVAL_ACCURACY: self.accuracy,
            m.EVAL_REWARD_MEAN: self.reward_mean,
            m.EVAL_RESPONSE_LENGTH_MEAN: sum(len(p.response_tokens) for p in self.problems) / len(self.problems),
            m.EVAL_PROBLEMS: float(len(self.problems)),
        }
        out.update({m.pass_at(k): self.pass_at(k) for k in self.ks})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "step": self.step,
            "metrics": self.metrics(),
            "problems": [p._asdict() for p in self.problems],
        }

    def write(self, path: str | Path) -> Path:
        """As JSON at `path` (written whole or not at all)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(self.to_dict(), indent=1))
        return path


def evaluate(engine: RolloutEngine, tokenizer, problems: list[Problem], instruction: str, reward: RewardConfig,
             plan: EvalPlan, batch_size: int, source: str, step: int | None = None,
             on_batch: Callable[[int], None] | None = None) -> EvalReport:
    """`problems` batch by batch on one engine; `on_batch(problems done)` after each batch."""
    results: list[ProblemEval] = []
    for batch in batches(problems, batch_size):
        results += evaluate_problems(engine, tokenizer, batch, instruction, reward, plan)
        if on_batch is not None:
            on_batch(len(batch))
    return EvalReport(source, step, results, plan.ks)
