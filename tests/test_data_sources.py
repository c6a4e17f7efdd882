"""load_problems dispatch and the Problem record."""

import dataclasses
import json

import pytest

from specroll.data import Problem, SyntheticConfig, generate_synthetic, load_problems


def test_synthetic_uses_the_given_config():
    cfg = SyntheticConfig(num_problems=5, seed=9)
    assert load_problems("synthetic", synthetic=cfg) == generate_synthetic(cfg)


def test_synthetic_default_with_limit():
    assert load_problems("synthetic", limit=3) == generate_synthetic(SyntheticConfig())[:3]


def test_gsm8k_from_a_jsonl_path(tmp_path):
    path = tmp_path / "mini.jsonl"
    path.write_text(json.dumps({"question": "1 + 2?", "answer": "1 + 2 = 3\n#### 3"}) + "\n")
    assert load_problems("gsm8k", path=str(path)) == [
        Problem(question="1 + 2?", answer="3", solution="1 + 2 = 3\n#### 3")
    ]


def test_unknown_name_lists_the_options():
    with pytest.raises(ValueError, match="synthetic, gsm8k"):
        load_problems("math500")


def test_problem_is_frozen():
    problem = Problem(question="q", answer="1", solution="#### 1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.answer = "2"
