"""Synthetic problems: determinism, arithmetic that checks out, and knob validation."""

import re

import pytest

from specroll.data import SyntheticConfig, extract_answer, generate_synthetic

STEP_LINE = re.compile(r"^.* (\d+) ([-+*/]) (\d+) = (\d+) .*\.$")
APPLY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
}


def test_same_seed_same_problems():
    cfg = SyntheticConfig(num_problems=50, seed=7)
    assert generate_synthetic(cfg) == generate_synthetic(SyntheticConfig(num_problems=50, seed=7))


def test_different_seeds_differ():
    first = generate_synthetic(SyntheticConfig(num_problems=20, seed=0))
    second = generate_synthetic(SyntheticConfig(num_problems=20, seed=1))
    assert [p.question for p in first] != [p.question for p in second]


def test_fewer_problems_is_a_prefix():
    many = generate_synthetic(SyntheticConfig(num_problems=30, seed=3))
    assert generate_synthetic(SyntheticConfig(num_problems=5, seed=3)) == many[:5]


@pytest.mark.parametrize("operations", [("+", "-", "*"), ("+", "-", "*", "/"), ("-", "/")])
def test_solutions_are_correct_bounded_step_by_step_arithmetic(operations):
    cfg = SyntheticConfig(
        num_problems=200, min_steps=2, max_steps=4, max_value=300, operations=operations, seed=11
    )
    problems = generate_synthetic(cfg)
    assert len(problems) == 200
    for problem in problems:
        lines = problem.solution.split("\n")
        start = int(re.search(r"\d+", lines[0]).group())
        assert str(start) in problem.question
        assert problem.question.endswith("?")
        assert lines[-1] == f"#### {problem.answer}"
        assert extract_answer(problem.solution) == problem.answer
        steps = lines[1:-1]
        assert cfg.min_steps <= len(steps) <= cfg.max_steps
        value = start
        for line in steps:
            before, op, amount, after = STEP_LINE.match(line).groups()
            assert op in operations
            assert int(before) == value
            assert APPLY[op](int(before), int(amount)) == int(after)
            value = int(after)
            assert 1 <= value <= cfg.max_value
        assert problem.answer == str(value)


def test_stories_vary():
    problems = generate_synthetic(SyntheticConfig(num_problems=200, seed=5))
    # The closing question names the counted item: "How many <item> ...?"
    items = {p.question.rsplit(". ", 1)[-1].split()[2] for p in problems}
    assert items == {"apples", "coins", "blank", "passengers", "cookies", "marbles", "books"}
    assert len({p.question for p in problems}) == 200


def test_operations_list_from_a_config_file_is_accepted():
    assert SyntheticConfig(operations=["+", "-"]).operations == ("+", "-")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_problems", 0),
        ("min_steps", 0),
        ("max_steps", 1),  # below the default min_steps of 2
        ("max_operand", 1),
        ("max_factor", 1),
        ("max_value", 10),  # below the default max_operand of 50
        ("seed", "0"),
        ("num_problems", 2.5),
        ("min_steps", True),
        ("operations", ()),
        ("operations", ("+", "%")),
    ],
)
def test_bad_knob_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SyntheticConfig(**{field: value})


def test_unsatisfiable_operations_raise():
    # Four halvings or more need a start of at least 16, but starts are at most 10.
    cfg = SyntheticConfig(
        num_problems=1, min_steps=4, max_steps=4, max_operand=10, operations=("/",)
    )
    with pytest.raises(ValueError, match="operations"):
        generate_synthetic(cfg)
