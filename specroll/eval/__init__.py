"""Evaluation of a policy on held-out problems: greedy accuracy and pass@k.

`python -m specroll.eval` evaluates a run checkpoint, a Hugging Face directory or a shipped model;
training evaluates its policy every `eval_every` steps through the same functions
(`evaluation.py`), so both give the same numbers for the same weights.
"""
from .pass_at_k import pass_at_k

__all__ = ["pass_at_k"]
