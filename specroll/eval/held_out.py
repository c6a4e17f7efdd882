"""The held-out problems a policy is evaluated on, chosen by the run's `data` and `eval` sections."""
from __future__ import annotations

from dataclasses import replace

from specroll.configs import DataConfig, EvalConfig
from specroll.data import Problem, generate_synthetic, load_problem_set, load_problems


def load_held_out(data: DataConfig, held_out: EvalConfig) -> list[Problem]:
    """`held_out.path` (or `data.path`) at `held_out.split`, read as `data.records` says, cut at
    `held_out.limit`; for synthetic problems, the `limit` (else `num_problems`) problems the
    generator draws after the training set's, which no training step sees."""
    if held_out.path is not None:
        return load_problem_set(held_out.path, data.records, split=held_out.split, subset=data.subset,
                                limit=held_out.limit)
    if data.name == "synthetic":
        train = data.synthetic.num_problems
        count = held_out.limit or train
        # A smaller num_problems draws a prefix of a larger one: the tail is new problems.
        return generate_synthetic(replace(data.synthetic, num_problems=train + count))[train:]
    return load_problems(data.name, data.path, held_out.split, held_out.limit, records=data.records,
                         subset=data.subset)
