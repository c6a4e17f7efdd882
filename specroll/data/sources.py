"""Choosing a problem set by name, as the training config does."""

from __future__ import annotations

from specroll.data.gsm8k import GSM8K_HUB, GSM8K_RECORDS, GSM8K_SUBSET
from specroll.data.problem_sets import load_problem_set
from specroll.data.problems import Problem, take_first
from specroll.data.records import RecordFormat
from specroll.data.synthetic import SyntheticConfig, generate_synthetic

# The problem sets that load by name alone; any other name needs a path (a file, folder or hub name).
PROBLEM_SOURCES: tuple[str, ...] = ("synthetic", "gsm8k")


def load_problems(
    name: str,
    path: str | None = None,
    split: str = "train",
    limit: int | None = None,
    synthetic: SyntheticConfig | None = None,
    records: RecordFormat | None = None,
    subset: str | None = None,
) -> list[Problem]:
    """Load the problem set ``name``.

    Args:
        name: ``"synthetic"`` (generated, no download), ``"gsm8k"``, or the name of any problem
            set read from ``path`` (``math`` and ``dapo_math`` have presets in ``conf/data/``).
        path: a jsonl, json, parquet or arrow file, a folder of ``<split>.<suffix>`` files or a
            hub dataset name; None means ``"openai/gsm8k"`` for gsm8k. Ignored for synthetic.
        split: the split to load from a folder or the hub. Ignored for synthetic.
        limit: keep only the first ``limit`` problems; None keeps all.
        synthetic: generator settings for synthetic; None means ``SyntheticConfig()``.
        records: the fields and answer format of the records; None means GSM8K's.
        subset: the hub dataset's configuration; gsm8k falls back to ``"main"``.
    """
    if name == "synthetic":
        return take_first(generate_synthetic(synthetic or SyntheticConfig()), limit)
    if name == "gsm8k":
        path, subset = path or GSM8K_HUB, subset or GSM8K_SUBSET
    if path is None:
        raise ValueError(f"problem set {name!r} needs a path: a file, a folder or a hub dataset name "
                         f"(only {', '.join(PROBLEM_SOURCES)} load by name alone)")
    return load_problem_set(path, records or GSM8K_RECORDS, split=split, subset=subset, limit=limit)
