"""Which problems leave no room for a whole response: prompt lengths against the run's token budget.

A prompt of `p` tokens fits when `p + rollout.max_new_tokens` is at most the longest sequence both
the learner (`learner.max_seq_len`) and the model (its context) take; otherwise its group fails a
step (the learner refuses it), and every resume would meet it again.
"""
from __future__ import annotations

from typing import NamedTuple

from specroll.data.problems import Problem
from specroll.data.prompts import prompt_text


class LongPrompt(NamedTuple):
    """A problem whose prompt leaves no room for a whole response."""

    where: str  # its source ("train.jsonl:12") or, for generated problems, its number
    tokens: int  # its prompt's length in tokens


def prompt_lengths(tokenizer, questions: list[str], instruction: str) -> list[int]:
    """The length of `format_prompt(tokenizer, q, instruction)` for each question, tokenized as one batch."""
    texts = [prompt_text(tokenizer, question, instruction) for question in questions]
    if not texts:
        return []
    special = tokenizer.chat_template is None  # as format_prompt: a template already wrote them
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=special)["input_ids"]]


def split_long_prompts(problems: list[Problem], lengths: list[int], max_prompt_tokens: int,
                       unnamed: str = "problem") -> tuple[list[Problem], list[LongPrompt]]:
    """`(problems that fit, in order; those longer than max_prompt_tokens, in order)`."""
    kept, long = [], []
    for index, (problem, tokens) in enumerate(zip(problems, lengths, strict=True)):
        if tokens <= max_prompt_tokens:
            kept.append(problem)
        else:
            long.append(LongPrompt(problem.source or f"{unnamed} {index + 1}", tokens))
    return kept, long
