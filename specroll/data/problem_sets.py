"""Loading a problem set through ``datasets``: a local jsonl, json, parquet or arrow file, a
folder of split files, or a dataset on the Hugging Face hub."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from specroll.config_checks import names_local_file
from specroll.data.problems import Problem, take_first
from specroll.data.records import RecordFormat, problem_from_record

# The `datasets` builder of each local file format, by suffix.
BUILDERS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
TEXT_SUFFIXES: tuple[str, ...] = (".jsonl", ".json")  # read as UTF-8 text
DATA_SUFFIXES: tuple[str, ...] = tuple(BUILDERS)
HUB_LOOKUP_TIMEOUT_S = 10.0  # one look-up of a hub dataset's name before loading it


def looks_local(path_or_name: str) -> bool:
    """Whether ``path_or_name`` means a local file even when it does not exist."""
    return names_local_file(path_or_name, DATA_SUFFIXES)


def split_file(folder: Path, split: str) -> Path | None:
    """The file of ``split`` in ``folder`` (``train.jsonl``, ``train.parquet``, ...), or None."""
    return next((folder / f"{split}{s}" for s in DATA_SUFFIXES if (folder / f"{split}{s}").is_file()), None)


def local_file(path_or_name: str, split: str) -> Path | None:
    """The local file ``path_or_name`` names (in a folder: the file of ``split``); None for a hub name.

    Raises:
        FileNotFoundError: a local path that does not exist, or a folder without a ``split`` file.
        ValueError: a file whose suffix is none of :data:`DATA_SUFFIXES`.
    """
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        found = split_file(path, split)
        if found is None:
            raise FileNotFoundError(f"folder {path} has no {split}.jsonl, nor a {split}.json, .parquet or .arrow file")
        return found
    if path.is_file():
        if path.suffix not in BUILDERS:
            raise ValueError(f"{path}: unknown file format {path.suffix!r}; use one of {', '.join(DATA_SUFFIXES)}")
        return path
    if looks_local(path_or_name):
        raise FileNotFoundError(f"file not found: {path}")
    return None


def _jsonl_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, line)`` of each non-blank line: the records of a jsonl file."""
    with path.open(encoding="utf-8") as lines:
        return [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]


def _check_utf8(path: Path) -> None:
    """Raise a ValueError naming the first line of a text file that is not UTF-8 (`datasets` names neither)."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: not UTF-8 text (byte 0x{line[error.start]:02x} at column "
                                 f"{error.start + 1}); save the file as UTF-8") from None


def _raise_bad_line(path: Path) -> None:
    """Raise a ValueError naming the first line of a jsonl file that is not a JSON object."""
    for number, line in _jsonl_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: invalid JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")


def _file_rows(path: Path) -> Iterable[dict]:
    # Imported here so that the synthetic default never pays for importing `datasets`.
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    if path.stat().st_size == 0:  # `datasets` fails on an empty file without naming it
        raise ValueError(f"{path} holds no problems: the file is empty")
    if path.suffix in TEXT_SUFFIXES:
        _check_utf8(path)
    try:
        return load_dataset(BUILDERS[path.suffix], data_files=str(path), split="train")
    except DatasetGenerationError as error:
        if path.suffix == ".jsonl":
            _raise_bad_line(path)
        raise ValueError(f"{path}: unreadable ({error.__cause__ or error})") from error


def _hub_rows(name: str, subset: str | None, split: str) -> Iterable[dict]:
    """The rows of hub dataset ``name``; one quick look-up first, so that a name the hub cannot
    answer (a mistyped local path, no network) fails at once rather than after `datasets`' retries."""
    from datasets import load_dataset
    from huggingface_hub import HfApi, constants

    not_local = f"{name!r} is not a local file or folder (none under {Path.cwd()})"
    if not (constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1"):
        try:
            HfApi().dataset_info(name, timeout=HUB_LOOKUP_TIMEOUT_S)
        except Exception as error:  # the hub client raises many types (no network, no such repo, gated)
            reason = str(error).splitlines()[0] if str(error) else ""
            raise ValueError(f"{not_local}, nor a dataset the hub answers for "
                             f"({type(error).__name__}: {reason})") from None
    try:
        return load_dataset(name, subset, split=split)
    except (ConnectionError, FileNotFoundError) as error:
        raise ValueError(f"{not_local}, and the hub dataset could not be read ({error})") from None


def _record_places(path: Path | None, name: str, split: str) -> Callable[[int], str]:
    """Where the record at an index is: a jsonl file's line, another file's record, a hub row."""
    if path is None:
        return lambda index: f"{name}[{split}] row {index}"
    if path.suffix == ".jsonl":
        line_numbers = [number for number, _ in _jsonl_lines(path)]  # once: a record's line is its non-blank line
        return lambda index: f"{path}:{line_numbers[index]}"
    return lambda index: f"{path} record {index + 1}"


def load_problem_set(
    path_or_name: str,
    records: RecordFormat,
    split: str = "train",
    subset: str | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Load the problems of a problem set through ``datasets.load_dataset``.

    Args:
        path_or_name: a ``.jsonl``, ``.json``, ``.parquet`` or ``.arrow`` file; a folder holding
            ``<split>.<suffix>``; or a dataset name on the hub such as ``"openai/gsm8k"``.
        records: where a record keeps its question and answer, how the answer is written and
            which levels to keep.
        split: the split to read from a folder or a hub dataset; ignored for a file.
        subset: the hub dataset's configuration (``"main"`` for openai/gsm8k); ignored for local files.
        limit: keep only the first ``limit`` problems (of the levels kept); None keeps all.

    Raises:
        FileNotFoundError: a local path that does not exist, or a folder without the split.
        ValueError: a malformed record, naming the file and line (jsonl), the record or the hub row;
            or no record left at ``records.levels``.
    """
    path = local_file(path_or_name, split)
    if path is not None:
        rows = _file_rows(path)
    else:
        rows = _hub_rows(path_or_name, subset, split)
    place = _record_places(path, path_or_name, split)
    problems = []
    for index, row in enumerate(rows):
        try:
            problem = problem_from_record(row, records)
        except ValueError as error:
            raise ValueError(f"{place(index)}: {error}") from None
        if problem is not None:
            problems.append(replace(problem, source=place(index)))
    if not problems:
        levels = f" at levels {list(records.levels)} of field {records.level_field!r}" if records.levels else ""
        raise ValueError(f"{path or path_or_name} holds no problems{levels}")
    return take_first(problems, limit)
