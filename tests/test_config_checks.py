"""The config field checks (specroll/config_checks.py) against hand-worked cases: what each accepts at
its bounds, what it refuses, and the one message format `<field> must be <allowed>, got <given>[: why]`."""
import math
import pickle
from pathlib import Path

import pytest

from specroll.config_checks import (FieldError, check_bool, check_choice, check_device, check_int, check_number,
                                    check_positive, check_probability, check_seed, check_text, names_local_file,
                                    not_found, require)
from specroll.configs import build_dataclass
from specroll.speculation import SpeculationConfig


def message(check, *args, **kwargs) -> str:
    with pytest.raises(FieldError) as info:
        check(*args, **kwargs)
    return str(info.value)


def test_ints_at_and_past_their_bounds():
    check_int("n", 2, 2)
    check_int("n", 5, 2, 5)
    check_int("n", -7)  # no bound: any int
    assert message(check_int, "n", 1, 2) == "n must be an int >= 2, got 1"
    assert message(check_int, "n", 6, 2, 5) == "n must be an int in [2, 5], got 6"
    assert message(check_int, "n", 6, None, 5) == "n must be an int <= 5, got 6"
    assert message(check_int, "n", True, 0) == "n must be an int >= 0, got True"  # a bool is no int here
    assert message(check_int, "n", 2.0, 1) == "n must be an int >= 1, got 2.0"
    assert message(check_int, "n", 1, 2, why="a group needs two") == "n must be an int >= 2, got 1: a group needs two"


def test_numbers_are_finite_and_open_or_closed_at_each_end():
    check_number("x", 0, 0)
    check_number("x", 0.5, 0, 1, low_open=True, high_open=True)
    check_number("x", -1e9)  # no bound: any finite number
    assert message(check_number, "x", 0.0, 0, low_open=True) == "x must be a finite number > 0, got 0.0"
    assert message(check_number, "x", 1, 0, 1, high_open=True) == "x must be a finite number in [0, 1), got 1"
    assert message(check_number, "x", 2.5, None, 2) == "x must be a finite number <= 2, got 2.5"
    assert message(check_number, "x", math.inf, 0) == "x must be a finite number >= 0, got inf"
    assert message(check_number, "x", math.nan) == "x must be a finite number, got nan"
    assert message(check_number, "x", False, 0) == "x must be a finite number >= 0, got False"
    assert message(check_number, "x", "1", 0) == "x must be a finite number >= 0, got '1'"


def test_positive_numbers_and_probabilities():
    check_positive("lr", 1e-12)
    assert message(check_positive, "lr", 0) == "lr must be a finite number > 0, got 0"
    assert message(check_positive, "lr", -1e-3) == "lr must be a finite number > 0, got -0.001"
    check_probability("p", 0.0)
    check_probability("p", 1.0)
    assert message(check_probability, "p", 1.0, high_open=True) == "p must be a finite number in [0, 1), got 1.0"
    assert message(check_probability, "p", 0.0, low_open=True) == "p must be a finite number in (0, 1], got 0.0"
    assert message(check_probability, "p", -0.1) == "p must be a finite number in [0, 1], got -0.1"


def test_bools_choices_texts_devices_and_seeds():
    check_bool("flag", False)
    assert message(check_bool, "flag", 0) == "flag must be a bool, got 0"
    check_choice("mode", "b", ("a", "b"))
    assert message(check_choice, "mode", "c", ("a", "b")) == "mode must be one of 'a', 'b', got 'c'"
    assert message(check_choice, "stage", 4, (0, 1)) == "stage must be one of 0, 1, got 4"
    check_text("name", "x")
    check_text("path", None, optional=True)
    assert message(check_text, "name", "") == "name must be a non-empty string, got ''"
    assert message(check_text, "path", "", optional=True) == "path must be null or a non-empty string, got ''"
    assert message(check_text, "name", None) == "name must be a non-empty string, got None"
    for device in ("auto", "cpu", "cuda", "cuda:3"):
        check_device("device", device)
    assert message(check_device, "device", "tpu") == "device must be 'auto', 'cpu' or 'cuda[:i]', got 'tpu'"
    assert message(check_device, "device", None) == "device must be 'auto', 'cpu' or 'cuda[:i]', got None"
    for seed in (0, -1, 2**40):
        check_seed("seed", seed)
    assert message(check_seed, "seed", 1.5) == "seed must be an int, got 1.5"
    assert message(check_seed, "seed", True) == "seed must be an int, got True"


def test_a_rule_of_the_configs_own_and_the_dotted_path():
    require(True, "max_nodes", 4, ">= min_nodes (2)")
    error = pytest.raises(FieldError, require, False, "max_nodes", 1, ">= min_nodes (2)").value
    assert str(error) == "max_nodes must be >= min_nodes (2), got 1"
    assert str(error.within("rollout.speculation")) == "rollout.speculation.max_nodes must be >= min_nodes (2), got 1"
    assert str(error.within("")) == str(error)
    copy = pickle.loads(pickle.dumps(error))  # crosses Ray's process boundaries
    assert type(copy) is FieldError and str(copy) == str(error)


def test_a_nested_config_is_named_by_its_path_once():
    """SpeculationConfig's own error names `max_nodes`; built as the run's `rollout.speculation`, the
    path is prepended once, and a config two levels down (drift) gets both levels."""
    assert message(SpeculationConfig, max_nodes=0) == "max_nodes must be an int >= 1, got 0: min_nodes is the least a step drafts"
    with pytest.raises(FieldError) as info:
        build_dataclass(SpeculationConfig, {"max_nodes": 0}, "rollout.speculation")
    assert str(info.value) == "rollout.speculation.max_nodes must be an int >= 1, got 0: min_nodes is the least a step drafts"
    with pytest.raises(FieldError) as info:
        build_dataclass(SpeculationConfig, {"drift": {"mad_floor": 0.0}}, "rollout.speculation")
    assert str(info.value) == "rollout.speculation.drift.mad_floor must be a finite number > 0, got 0.0"


def test_paths_told_from_names_and_a_missing_one_said_as_read():
    assert names_local_file("./data", (".jsonl",)) and names_local_file("~/x", ()) and names_local_file("/x", ())
    assert names_local_file("train.jsonl", (".jsonl",)) and not names_local_file("openai/gsm8k", (".jsonl",))
    assert not_found("/no/such.jsonl") == "not found"
    assert not_found("~/no/such.jsonl") == f"{Path('~/no/such.jsonl').expanduser()} not found"
