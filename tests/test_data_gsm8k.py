"""GSM8K loading from the shared local copy and from hand-made malformed files."""

import json
from pathlib import Path

import pytest

from specroll.data import (
    answers_match,
    extract_answer,
    load_gsm8k,
    load_problems,
    strip_calculator_annotations,
)

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"


@pytest.fixture(scope="module")
def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "test.jsonl").is_file():
        pytest.skip(f"GSM8K copy not found at {GSM8K_DIR}")
    return GSM8K_DIR


def test_first_test_problem_matches_the_file(gsm8k_dir):
    first = load_gsm8k(str(gsm8k_dir / "test.jsonl"), limit=1)[0]
    assert first.question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first.answer == "18"
    assert first.solution == (
        "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\n"
        "She makes 9 * 2 = $18 every day at the farmer\u2019s market.\n"
        "#### 18"
    )


def test_whole_test_split_parses_and_answers_agree(gsm8k_dir):
    problems = load_gsm8k(str(gsm8k_dir), split="test")
    assert len(problems) == 1319
    for problem in problems:
        assert "<<" not in problem.solution
        assert answers_match(extract_answer(problem.solution), problem.answer)
    # Gold answers written with thousands commas become canonical integers.
    assert "1450000" in {p.answer for p in problems if p.solution.endswith("#### 1,450,000")}


def test_folder_and_split_with_limit(gsm8k_dir):
    problems = load_gsm8k(str(gsm8k_dir), split="train", limit=2)
    assert [p.answer for p in problems] == ["72", "10"]
    assert problems[0].question.startswith("Natalia sold clips to 48 of her friends")


def test_load_problems_reads_gsm8k_from_a_path(gsm8k_dir):
    problems = load_problems("gsm8k", path=str(gsm8k_dir), split="test", limit=3)
    assert [p.answer for p in problems] == ["18", "3", "70000"]


def _write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


GOOD = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"})


def test_blank_lines_are_skipped(tmp_path):
    problems = load_gsm8k(_write_lines(tmp_path / "ok.jsonl", [GOOD, "", GOOD]))
    assert [p.answer for p in problems] == ["4", "4"]
    assert problems[0].solution == "2 + 2 = 4\n#### 4"


def test_invalid_json_names_the_line(tmp_path):
    path = _write_lines(tmp_path / "bad.jsonl", [GOOD, "", '{"question": "unterminated'])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON"):
        load_gsm8k(path)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"question": "Q?"}, "'answer'"),
        ({"question": 3, "answer": "#### 3"}, "'question'"),
        ({"question": "Q?", "answer": "It is 4."}, "#### <number>"),
        ({"question": "Q?", "answer": "#### four"}, "#### <number>"),
        (["Q?", "#### 4"], "JSON object"),
    ],
)
def test_malformed_record_names_line_and_problem(tmp_path, record, message):
    path = _write_lines(tmp_path / "bad.jsonl", [GOOD, json.dumps(record)])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*" + message.replace("#", r"\#")):
        load_gsm8k(path)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_gsm8k(str(missing))


def test_folder_without_the_split(tmp_path):
    with pytest.raises(FileNotFoundError, match="validation.jsonl"):
        load_gsm8k(str(tmp_path), split="validation")


def test_bad_limit(tmp_path):
    with pytest.raises(ValueError, match="limit"):
        load_gsm8k(_write_lines(tmp_path / "ok.jsonl", [GOOD]), limit=0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips.", "Natalia sold 48/2 = 24 clips."),
        ("$<<9*2=18>>18 and <<1+1=2>>2", "$18 and 2"),
        ("No annotations, 3 < 4 > 2.", "No annotations, 3 < 4 > 2."),
    ],
)
def test_strip_calculator_annotations(text, expected):
    assert strip_calculator_annotations(text) == expected
