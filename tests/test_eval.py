"""Evaluation (`specroll.eval`): the pass@k estimator by hand, the held-out problems, a checkpoint's
accuracy counted by hand on a fixture built from the model's own greedy answers (transformers as
the oracle), and training's `eval_every`: its evals and metrics, reproduced exactly by
`python -m specroll.eval` on the final checkpoint."""
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from specroll.configs import EvalConfig, load_train_config
from specroll.data import format_prompt, generate_synthetic
from specroll.eval import pass_at_k
from specroll.eval.__main__ import main as eval_main
from specroll.eval.__main__ import parse_args, run_eval
from specroll.eval.held_out import load_held_out
from specroll.learner import GRPOLearner, LearnerConfig, export_hf, save_checkpoint
from specroll.models import build_tiny_model
from specroll.telemetry import metric_names as m
from specroll.train import run_training

CONF = Path(__file__).resolve().parents[1] / "conf"
QUESTIONS = ["How many legs do 3 spiders have?", "What is 17 + 25?", "A box holds 6 eggs. How many in 4 boxes?",
             "Sam had 40 apples and ate 3. How many are left?", "What is 9 times 9?", "Half of 58 is what?"]
RIGHT = [True, False, True, True, False, False]  # which answers the fixture makes the model's own
NEW_TOKENS = 5


def config(tmp_path, overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return load_train_config(compose("config", overrides=["experiment=smoke", f"run_dir={tmp_path / 'run'}",
                                                              "logger.console=false", *overrides]))


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 1 - 3 / 6  # C(3,2) of the C(4,2) pairs miss the one right response
    assert pass_at_k(5, 2, 3) == 1 - 1 / 10  # one of the C(5,3) draws holds only wrong ones: C(3,3)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong responses than k: a draw of k holds a right one
    with pytest.raises(ValueError, match="k"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="correct"):
        pass_at_k(4, 5, 1)


def test_the_guides_eval_commands_parse():
    text = (CONF.parent / "docs" / "guide.md").read_text().replace("\\\n", " ")
    commands = re.findall(r"-m specroll\.eval ([^\n`]*)", text)
    assert len(commands) >= 4
    for argv in commands:
        parse_args(shlex.split(argv, comments=True))
    mixed = parse_args(["runs/x", "eval.split=dev", "--limit", "2", "data.path=/d", "--n", "4"])
    assert mixed.overrides == ["eval.split=dev", "data.path=/d"] and (mixed.limit, mixed.n) == (2, 4)


def test_eval_settings_fail_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"^k\[1\] must be an int in \[1, 4\], got 5: pass@k draws k of the `samples` responses$"):
        EvalConfig(samples=4, k=[1, 5])
    with pytest.raises(ValueError, match="^batch_size must be an int >= 1, got 0$"):
        EvalConfig(batch_size=0)
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
    with pytest.raises(ValueError, match=r"^eval.path must be a file of held-out problems, got None: data.path .* is one file"):
        config(tmp_path, ["data=gsm8k", f"data.path={train}", "eval_every=1"])
    with pytest.raises(ValueError, match=r"^eval.split must be a split of data.path's folder .*, or eval.path set, got 'test': "
                                         r".* has no test file$"):
        config(tmp_path, ["data=gsm8k", f"data.path={tmp_path}", "data.split=train", "eval_every=1"])


def test_synthetic_held_out_problems_follow_the_training_set():
    cfg = load_train_config({"data": {"synthetic": {"num_problems": 10}}, "eval": {"limit": 4}})
    held_out = load_held_out(cfg.data, cfg.eval)
    assert held_out == generate_synthetic(cfg.data.synthetic.__class__(num_problems=14))[10:]


def digit_policy(tokenizer):
    """A tiny random Llama that only ever writes digits: its greedy response to a question is a number."""
    model = build_tiny_model("llama", seed=3, init_std=0.3, vocab_size=len(tokenizer),
                             eos_token_ids=[tokenizer.eos_token_id])
    digits = torch.tensor(tokenizer.convert_tokens_to_ids([str(d) for d in range(10)]))
    with torch.no_grad():
        keep = model.lm_head.weight[digits].clone()
        model.lm_head.weight.zero_()
        model.lm_head.weight[digits] = keep
    return model


def oracle_answers(model, tokenizer, tmp_path) -> list[str]:
    """The model's greedy answers to QUESTIONS as transformers decodes them (not our engine)."""
    hf = AutoModelForCausalLM.from_pretrained(export_hf(model, model.config, tokenizer, tmp_path / "oracle")).eval()
    answers = []
    for question in QUESTIONS:
        prompt = torch.tensor([format_prompt(tokenizer, question, "")])
        out = hf.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.eos_token_id)
        answers.append(tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True))
    return answers


def test_a_checkpoints_accuracy_is_the_one_counted_by_hand(tmp_path, smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = digit_policy(tokenizer)
    answers = oracle_answers(model, tokenizer, tmp_path)
    assert all(a.isdigit() for a in answers), answers
    # The fixture: the model's own answer where RIGHT says so, one more than it elsewhere.
    data = tmp_path / "mini"
    data.mkdir()
    records = [{"question": q, "answer": a if right else str(int(a) + 1)} for q, a, right in zip(QUESTIONS, answers, RIGHT)]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = config(tmp_path, ["data.name=mini", f"data.path={data}", "data.records.answer_format=number",
                            "data.instruction=''", f"rollout.max_new_tokens={NEW_TOKENS}", "eval.batch_size=4"])
    learner = GRPOLearner(model, LearnerConfig(device="cpu", micro_batch_tokens=1024, max_response_len=16,
                                               max_seq_len=256))
    save_checkpoint(learner, Path(cfg.run_dir) / "checkpoints", step=0, run_config=cfg.to_dict())

    for decoding in ("speculative", "plain"):
        _, report = run_eval(cfg.run_dir, [f"rollout.mode={'speculation' if decoding == 'speculative' else 'vanilla'}"],
                             show_progress=False)
        assert [p.response for p in report.problems] == answers
        assert [p.correct for p in report.problems] == RIGHT
        assert report.accuracy == 0.5 and report.metrics()[m.EVAL_ACCURACY] == 0.5
    out = tmp_path / "eval.json"
    eval_main([cfg.run_dir, "--decoding", "plain", "--limit", "4", "--n", "3", "--k", "1,3", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert [p["correct"] for p in saved["problems"]] == RIGHT[:4]
    assert saved["metrics"][m.EVAL_ACCURACY] == 0.75 and saved["step"] == 0
    problems = saved["problems"]
    assert saved["metrics"][m.pass_at(3)] == pytest.approx(sum(p["samples_correct"] > 0 for p in problems) / 4)


def test_eval_every_logs_evals_and_the_command_reproduces_the_last(ray_cluster, tmp_path):
    cfg = config(tmp_path, ["total_steps=3", "eval_every=2", "eval.limit=3", "eval.samples=2", "eval.k=[1,2]",
                            "eval.batch_size=2", "cluster.num_rollout_actors=2"])
    summary = run_training(cfg)
    evals = Path(cfg.run_dir) / "evals"
    # the initial policy (eval.before_training), then after updates 2 and 3 (the last)
    assert sorted(p.name for p in evals.iterdir()) == ["step_00000000.json", "step_00000002.json", "step_00000003.json"]
    assert json.loads((evals / "step_00000000.json").read_text())["step"] == 0
    assert summary.last_eval == str(evals / "step_00000003.json")
    rows = [json.loads(line) for line in Path(summary.metrics_file).read_text().splitlines()]
    assert [m.EVAL_ACCURACY in r for r in rows] == [False, True, True]
    assert all(r[m.EVAL_PROBLEMS] == 3 and 0 <= r[m.pass_at(2)] <= 1 and r[m.TIME_EVAL] > 0 for r in rows[1:])
    assert "held-out accuracy, first -> last eval" in summary.table and "(after 0 -> 3 updates)" in summary.table
    last = json.loads((evals / "step_00000003.json").read_text())
    assert last["metrics"] == {k: rows[2][k] for k in last["metrics"]}

    _, report = run_eval(cfg.run_dir, [], show_progress=False)
    reproduced = json.loads(json.dumps(report.to_dict()))
    assert reproduced["step"] == last["step"] == 3
    assert reproduced["problems"] == last["problems"]
    assert reproduced["metrics"] == last["metrics"]
