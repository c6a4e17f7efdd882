"""GSM8K: its record format, and loading it from a local file or folder or from the hub."""

from __future__ import annotations

from specroll.data.problem_sets import load_problem_set
from specroll.data.problems import Problem
from specroll.data.records import RecordFormat

# {"question": ..., "answer": "<worked solution>\n#### <number>"}, as openai/gsm8k writes them.
GSM8K_RECORDS = RecordFormat(question="question", answer="answer", answer_format="gsm8k")
GSM8K_HUB = "openai/gsm8k"
GSM8K_SUBSET = "main"


def load_gsm8k(path_or_name: str, split: str = "train", limit: int | None = None) -> list[Problem]:
    """Load GSM8K problems.

    Args:
        path_or_name: a GSM8K-format file (jsonl, json, parquet or arrow; one ``{"question",
            "answer"}`` record each, the answer ending in ``#### <number>``); a folder holding
            ``<split>.jsonl`` (or another of those formats); or a dataset name on the hub read
            with its ``"main"`` configuration, such as ``"openai/gsm8k"``.
        split: the split to read from a folder or a named dataset; ignored for a file.
        limit: keep only the first ``limit`` problems; None keeps all.

    Raises:
        FileNotFoundError: a path (absolute, relative, or ending in a data suffix) that does not
            exist, or a folder without the split.
        ValueError: a malformed record, naming the file and line.
    """
    return load_problem_set(path_or_name, GSM8K_RECORDS, split=split, subset=GSM8K_SUBSET, limit=limit)
