"""The tools' command-line flags (`specroll.tools.flags`): made from config dataclasses, and the
flags the commands share."""
import argparse
import dataclasses
import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

import specroll
from specroll.learner.sft_trainer import SFTConfig
from specroll.speculation.head_training.samples import SampleConfig
from specroll.speculation.head_training.training import HeadTrainConfig
from specroll.tools.flags import DEFAULT_MODEL, add_config_arguments, config_from_args, field_docs
from specroll.tools.compare_runs import parse_args as compare_runs_args
from specroll.tools.export import parse_args as export_args
from specroll.tools.pretrain_drafter import parse_args as pretrain_args
from specroll.tools.profile import parse_args as profile_args
from specroll.tools.sft import parse_args as sft_args
from specroll.tools.train_heads import parse_args as train_heads_args


@dataclass
class Base:
    """A base config."""

    depth: int = 3  # layers per head
    rate: float = 0.5
    """Share of rows kept, in [0, 1]."""


@dataclass
class Knobs(Base):
    """Knobs of a made-up command.

    More text that stays out of the help's group line.
    """

    name: str = "path"  # which kind: "path" or "medusa" # not a second comment
    limit: int | None = None  # keep only the first `limit` rows; 100% without
    fast: bool = False  # skip the slow checks
    sizes: tuple[int, ...] = field(default_factory=lambda: (4, 8))  # no flag for tuples

    def __post_init__(self) -> None:
        if not 0 <= self.rate <= 1:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")


def parser_for(**kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="knobs")
    add_config_arguments(p, Knobs, exclude=("sizes",), **kwargs)
    return p


def test_field_docs_read_line_comments_and_docstrings_below_fields_including_inherited_ones():
    assert field_docs(Knobs) == {
        "depth": "layers per head",
        "rate": "Share of rows kept, in [0, 1].",
        "name": 'which kind: "path" or "medusa" # not a second comment',
        "limit": "keep only the first `limit` rows; 100% without",
        "fast": "skip the slow checks",
        "sizes": "no flag for tuples",
    }


def test_flags_parse_each_fields_type_and_default_to_the_fields_values():
    p = parser_for()
    assert config_from_args(Knobs, p.parse_args([])) == Knobs()
    args = p.parse_args(["--depth", "5", "--rate", "0.25", "--name", "medusa", "--limit", "7", "--fast"])
    assert config_from_args(Knobs, args) == Knobs(depth=5, rate=0.25, name="medusa", limit=7, fast=True)
    assert config_from_args(Knobs, p.parse_args(["--no-fast"]), sizes=(2,)) == Knobs(fast=False, sizes=(2,))
    with pytest.raises(SystemExit):
        p.parse_args(["--depth", "1.5"])


def test_help_names_each_field_with_its_documentation_and_default():
    text = parser_for(defaults={"depth": 9}).format_help()
    assert "Knobs of a made-up command." in text and "More text" not in text
    assert "layers per head (default: 9)" in " ".join(text.split())  # the command's default, not the field's
    assert "100% without" in " ".join(text.split())  # a literal %, which argparse would otherwise format
    assert "--sizes" not in text


def test_a_class_defined_in_a_function_reads_its_own_comments_but_not_lint_directives():
    @dataclass
    class Local:
        """Defined here.
Its second line sits at column 0, so the class's source alone does not parse."""

        sizes: tuple[int, ...] = (  # kept sizes
            4, 8)
        share: str = "50%"  # noqa: E501
        quiet: bool = True

    assert field_docs(Local) == {"sizes": "kept sizes"}
    p = argparse.ArgumentParser()
    add_config_arguments(p, Local, exclude=("sizes",))
    text = " ".join(p.format_help().split())
    assert "--share SHARE (default: 50%)" in text and "--quiet, --no-quiet (default: True)" in text
    assert config_from_args(Local, p.parse_args(["--no-quiet"])) == Local(quiet=False)


def test_a_field_that_takes_no_flag_must_be_excluded():
    with pytest.raises(TypeError, match="Knobs.sizes"):
        add_config_arguments(argparse.ArgumentParser(), Knobs)


def test_a_value_the_config_refuses_is_a_usage_error_naming_the_check(capsys):
    p = parser_for()
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(Knobs, p.parse_args(["--rate", "2"]), p)
    assert exit_info.value.code == 2 and "rate must be in [0, 1], got 2.0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rate must be"):  # no parser: the config's own error
        config_from_args(Knobs, p.parse_args(["--rate", "2"]))


def test_sft_command_has_a_documented_flag_for_every_recipe_field():
    docs = field_docs(SFTConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(SFTConfig)}
    args, cfg = sft_args(["--lr", "1e-4", "--epochs", "3", "--precision", "float32", "--max-steps", "2"])
    assert cfg == SFTConfig(lr=1e-4, epochs=3, precision="float32", max_steps=2)
    assert args.model == "smollm2-135m-instruct"


def test_head_and_drafter_commands_draw_their_samples_as_their_flags_say():
    args = train_heads_args(["--out", "h.safetensors", "--positions", "500", "--max-new-tokens", "64", "--seed", "3"])
    assert args.sample_config == SampleConfig(positions=500, max_new_tokens=64, seed=3)
    # The drafter's command samples fewer positions by default, the same way otherwise (one samples cache).
    assert pretrain_args(["--out", "d.safetensors"]).sample_config == SampleConfig(positions=20_000)
    with pytest.raises(SystemExit):
        train_heads_args(["--out", "h.safetensors", "--temperature", "0.5"])  # heads learn the policy's own samples


def test_head_training_flags_set_its_config_and_epochs_0_evaluates_with_the_rest():
    args = train_heads_args(["--out", "h.safetensors", "--lr", "3e-4", "--nll-weight", "0.5", "--seed", "2"])
    assert args.train_config == HeadTrainConfig(lr=3e-4, nll_weight=0.5, seed=2)
    args = train_heads_args(["--out", "h.safetensors", "--epochs", "0", "--eval-positions", "64"])
    assert args.epochs == 0 and args.train_config.eval_positions == 64
    for bad in (["--epochs", "-1"], ["--draft-vocab", "-1"], ["--lr", "0"]):
        with pytest.raises(SystemExit):
            train_heads_args(["--out", "h.safetensors", *bad])


def test_every_command_takes_the_common_flags_with_the_same_defaults():
    sft, _ = sft_args([])
    parsed = [sft, train_heads_args(["--out", "h.safetensors"]), pretrain_args(["--out", "d.safetensors"])]
    for args in parsed:
        assert (args.model, args.dataset, args.data_path, args.seed) == (DEFAULT_MODEL, "synthetic", None, 0)
    assert profile_args([]).model == DEFAULT_MODEL
    assert sft_args(["--seed", "3"])[1].seed == 3  # the common --seed is the SFT recipe's
    assert train_heads_args(["--dataset", "gsm8k,synthetic", "--out", "h"]).dataset == "gsm8k,synthetic"
    with pytest.raises(SystemExit):
        sft_args(["--dataset", "gsm8k,synthetic"])  # SFT trains on one problem set
    with pytest.raises(SystemExit):
        pretrain_args([])  # the drafter's command needs --out


TOOL_PARSERS = {"sft": sft_args, "train_heads": train_heads_args, "pretrain_drafter": pretrain_args,
                "profile": profile_args, "export": export_args, "compare_runs": compare_runs_args}
# The module paths the shipped assets' summaries recorded: today's, and those before the commands moved to specroll.tools.
RECORDED_AS = {**{f"specroll.tools.{name}": name for name in TOOL_PARSERS},
               "specroll.spec.train_heads": "train_heads", "specroll.speculation.head_training.training": "train_heads",
               "specroll.fastgrpo.pretrain": "pretrain_drafter", "specroll.learner.sft": "sft"}


def recorded_summaries(summary: dict | None):
    """A saved summary and those of the heads it started from, newest first."""
    while summary:
        yield summary
        summary = summary.get("init_summary")


def test_the_shipped_heads_and_drafter_commands_parse_to_the_configs_they_recorded():
    assets = Path(specroll.__file__).parent / "assets"
    summaries = [summary for path in sorted(assets.glob("*/*.json"))
                 for summary in recorded_summaries(json.loads(path.read_text()))]
    assert len(summaries) >= 3
    for summary in summaries:
        _, _, module, *argv = shlex.split(summary["command"])
        args = TOOL_PARSERS[RECORDED_AS[module]](argv)
        assert asdict(args.sample_config) == summary["sample_config"], summary["command"]
        if summary.get("train_config") and hasattr(args, "train_config"):
            assert json.loads(json.dumps(asdict(args.train_config))) == summary["train_config"], summary["command"]


def test_the_guides_commands_parse():
    text = (Path(__file__).parents[1] / "docs" / "guide.md").read_text().replace("\\\n", " ")
    commands = re.findall(r"-m specroll\.tools\.(\w+) ([^\n`]*)", text)
    assert {name for name, _ in commands} >= {"sft", "train_heads", "pretrain_drafter"}
    for name, argv in commands:
        TOOL_PARSERS[name](shlex.split(argv))
