"""The responses log (`logger.rollouts`): one line per step, read back as written; a resumed run drops
the lines of the steps it redoes; two runs compared response by response (`tools.compare_runs`)."""
import json

import pytest

from specroll.actors.batch import Rollouts
from specroll.telemetry.rollout_log import ROLLOUTS_NAME, RolloutLog, read_rollouts
from specroll.tools.compare_runs import compare_runs, main


def rollouts(step, responses, rewards):
    return Rollouts(step=step, group_size=2, policy_version=step, head_version=None, prompt_indices=[0],
                    prompt_ids=[[1, 2, 3]], response_ids=responses, logprobs=[[0.0] * len(r) for r in responses],
                    finish_reasons=["stop"] * len(responses), rewards=rewards, correct=[r > 0 for r in rewards])


def write_run(run_dir, steps, first_step=0):
    log = RolloutLog(run_dir / ROLLOUTS_NAME, first_step)
    for r in steps:
        log.write(r)
    log.close()


def test_lines_read_back_and_a_resume_drops_the_steps_it_redoes(tmp_path):
    write_run(tmp_path, [rollouts(s, [[s, 7], [8]], [1.0, 0.0]) for s in range(4)])
    with (tmp_path / ROLLOUTS_NAME).open("a") as f:
        f.write('{"step": 4, "policy_ver')  # a crash mid-line
    logged = read_rollouts(tmp_path)
    assert sorted(logged) == [0, 1, 2, 3]
    assert logged[2].response_ids == [[2, 7], [8]] and logged[2].rewards == [1.0, 0.0] and logged[2].policy_version == 2
    write_run(tmp_path, [rollouts(2, [[9]], [0.5])], first_step=2)  # resumed from the checkpoint after step 1
    lines = [json.loads(line) for line in (tmp_path / ROLLOUTS_NAME).read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[2]["response_ids"] == [[9]]


def test_two_runs_compared_response_by_response(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, [rollouts(0, [[1, 2], [3]], [1.0, 0.0]), rollouts(1, [[4], [5, 6]], [0.0, 1.0])])
    write_run(b, [rollouts(0, [[1, 2], [3]], [1.0, 0.0]), rollouts(1, [[4], [5, 7]], [0.0, 0.0]),
                  rollouts(2, [[1], [1]], [0.0, 0.0])])
    steps = compare_runs(read_rollouts(a), read_rollouts(b))
    assert [(s.step, s.identical, s.responses, s.same_prompts) for s in steps] == [(0, 2, 2, True), (1, 1, 2, True)]
    assert steps[1].reward_a == 0.5 and steps[1].reward_b == 0.0
    out = main([str(a), str(b), "--json", str(tmp_path / "cmp.json")])
    same = out["identity"]["b"]
    assert same["identical"] == 3 and same["responses"] == 4 and same["first_difference_step"] == 1
    assert "identical responses, b and a: 3/4 (75.0%) over 2 steps; the first difference is at step 1" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="logger.rollouts=true"):
        read_rollouts(tmp_path / "missing")
