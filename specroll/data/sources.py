"""Choosing a problem set by name, as the training config does."""

from __future__ import annotations

from specroll.data.gsm8k import load_gsm8k
from specroll.data.problems import Problem, take_first
from specroll.data.synthetic import SyntheticConfig, generate_synthetic

PROBLEM_SOURCES: tuple[str, ...] = ("synthetic", "gsm8k")
DEFAULT_GSM8K = "openai/gsm8k"


def load_problems(
    name: str,
    path: str | None = None,
    split: str = "train",
    limit: int | None = None,
    synthetic: SyntheticConfig | None = None,
) -> list[Problem]:
    """Load the problem set ``name``.

    Args:
        name: ``"synthetic"`` (generated, no download) or ``"gsm8k"``.
        path: for gsm8k, a jsonl file, a folder of ``<split>.jsonl`` files or a dataset name;
            None means ``"openai/gsm8k"`` through ``datasets``. Ignored for synthetic.
        split: for gsm8k, the split to load. Ignored for synthetic.
        limit: keep only the first ``limit`` problems; None keeps all.
        synthetic: generator settings for synthetic; None means ``SyntheticConfig()``.
            Ignored for gsm8k.
    """
    if name == "synthetic":
        return take_first(generate_synthetic(synthetic or SyntheticConfig()), limit)
    if name == "gsm8k":
        return load_gsm8k(path or DEFAULT_GSM8K, split=split, limit=limit)
    raise ValueError(f"unknown problem set {name!r}; choose one of {', '.join(PROBLEM_SOURCES)}")
