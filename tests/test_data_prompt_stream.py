"""PromptStream: epoch coverage, determinism and exact resume."""

import pytest

from specroll.data import Problem, PromptStream

PROBLEMS = [Problem(question=f"q{i}", answer=str(i), solution=f"#### {i}") for i in range(10)]


def questions(batches):
    return [[p.question for p in batch] for batch in batches]


def take(stream, count):
    return [next(stream) for _ in range(count)]


def test_resume_continues_at_the_same_position():
    stream = PromptStream(PROBLEMS, batch_size=4, seed=3)
    take(stream, 3)
    state = stream.state_dict()
    assert state == {"epoch": 1, "index": 2}  # 12 problems drawn from epochs of 10
    expected = take(stream, 2)

    resumed = PromptStream(PROBLEMS, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    assert take(resumed, 2) == expected


def test_each_epoch_is_a_new_permutation():
    stream = PromptStream(PROBLEMS, batch_size=5, seed=0)
    epoch0 = [p.question for batch in take(stream, 2) for p in batch]
    epoch1 = [p.question for batch in take(stream, 2) for p in batch]
    assert sorted(epoch0) == sorted(epoch1) == sorted(p.question for p in PROBLEMS)
    assert epoch0 != epoch1
    assert stream.epoch == 2


def test_same_seed_same_batches_and_different_seed_differs():
    def first_batches(seed):
        return questions(take(PromptStream(PROBLEMS, batch_size=3, seed=seed), 5))

    assert first_batches(1) == first_batches(1)
    assert first_batches(1) != first_batches(2)


def test_unshuffled_order_wraps_across_epochs():
    stream = PromptStream(PROBLEMS, batch_size=4, seed=0, shuffle=False)
    assert questions(take(stream, 3)) == [
        ["q0", "q1", "q2", "q3"],
        ["q4", "q5", "q6", "q7"],
        ["q8", "q9", "q0", "q1"],
    ]


def test_batch_larger_than_the_problem_set():
    batch = next(PromptStream(PROBLEMS[:3], batch_size=7, seed=0, shuffle=False))
    assert [p.question for p in batch] == ["q0", "q1", "q2", "q0", "q1", "q2", "q0"]


def test_caller_editing_its_list_does_not_move_the_stream():
    problems = list(PROBLEMS)
    stream = PromptStream(problems, batch_size=2, seed=0, shuffle=False)
    problems.clear()
    assert [p.question for p in next(stream)] == ["q0", "q1"]


@pytest.mark.parametrize(
    ("problems", "batch_size", "message"),
    [([], 2, "at least one problem"), (PROBLEMS, 0, "batch_size"), (PROBLEMS, 2.0, "batch_size")],
)
def test_invalid_construction(problems, batch_size, message):
    with pytest.raises(ValueError, match=message):
        PromptStream(problems, batch_size=batch_size, seed=0)


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"epoch": 0}, "index"),
        ({"epoch": -1, "index": 0}, "epoch"),
        ({"epoch": 0, "index": 10}, "different problem set"),
    ],
)
def test_invalid_state(state, message):
    stream = PromptStream(PROBLEMS, batch_size=2, seed=0)
    with pytest.raises(ValueError, match=message):
        stream.load_state_dict(state)
