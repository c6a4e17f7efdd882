"""GSM8K loading, from a local jsonl file or through ``datasets.load_dataset``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from specroll.data.problems import Problem, take_first
from specroll.data.rewards import extract_answer

_CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")
_PATH_SUFFIXES = (".jsonl", ".json")


def strip_calculator_annotations(text: str) -> str:
    """Remove GSM8K calculator annotations: ``"48/2 = <<48/2=24>>24"`` -> ``"48/2 = 24"``."""
    return _CALCULATOR_ANNOTATION.sub("", text)


def _problem_from_record(record: object, where: str) -> Problem:
    """Turn one ``{"question", "answer"}`` record into a Problem; ``where`` locates errors."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("question", "answer"):
        if not isinstance(record.get(key), str):
            raise ValueError(f"{where}: missing or non-string field {key!r}")
    # The annotations are calculator-tool markup the policy never produces at rollout time.
    solution = strip_calculator_annotations(record["answer"]).strip()
    _, marker, final = solution.rpartition("####")
    answer = extract_answer(final) if marker else None
    if answer is None:
        raise ValueError(f"{where}: answer does not end with a '#### <number>' line")
    return Problem(question=record["question"].strip(), answer=answer, solution=solution)


def _read_jsonl(path: Path) -> list[Problem]:
    problems = []
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: invalid JSON ({error.msg})") from error
            problems.append(_problem_from_record(record, f"{path}:{line_number}"))
    return problems


def _read_hub(name: str, split: str) -> list[Problem]:
    # Imported here so that the synthetic default never pays for importing `datasets`.
    from datasets import load_dataset

    rows: Iterable[dict] = load_dataset(name, "main", split=split)
    return [
        _problem_from_record(row, f"{name}[{split}] row {index}")
        for index, row in enumerate(rows)
    ]


def load_gsm8k(path_or_name: str, split: str = "train", limit: int | None = None) -> list[Problem]:
    """Load GSM8K problems.

    Args:
        path_or_name: a GSM8K-format jsonl file (one ``{"question", "answer"}`` object per
            line, the answer ending in ``#### <number>``); a folder holding ``<split>.jsonl``;
            or a dataset name for ``datasets.load_dataset(name, "main")`` such as
            ``"openai/gsm8k"``.
        split: the split to read from a folder or a named dataset; ignored for a file.
        limit: keep only the first ``limit`` problems; None keeps all.

    Raises:
        FileNotFoundError: a path (absolute, relative, or ending in .jsonl/.json) that does not
            exist, or a folder without ``<split>.jsonl``.
        ValueError: a malformed record, naming the file and line.
    """
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        path = path / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"GSM8K folder {path.parent} has no {path.name}")
    if path.is_file():
        return take_first(_read_jsonl(path), limit)
    if path_or_name.startswith(("/", ".", "~")) or path_or_name.endswith(_PATH_SUFFIXES):
        raise FileNotFoundError(f"GSM8K file not found: {path}")
    return take_first(_read_hub(path_or_name, split), limit)
