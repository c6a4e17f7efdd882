"""Every input of a run checked before Ray or any model starts, all problems in one message.

The run_dir (absolute, outside Ray's per-job working directory, it and its checkpoints folder
writable), the problem set (readable, UTF-8, not empty, named by file and line), the model's
limits, every prompt's length against the token budget (`data.long_prompts`: fail names the
first one too long, drop leaves them all out of the run), and the memory plan against
`cluster.gpu_memory_gb` (`specroll.plan`). Needs the tokenizer and the model's config, never its
weights; writes nothing.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from specroll.configs import TrainConfig, validate_against_model
from specroll.configs.train_config import RESUME_MODES
from specroll.data import Problem, load_problems
from specroll.data.prompt_lengths import prompt_lengths, split_long_prompts
from specroll.plan import check_fits
from specroll.run_dir import CHECKPOINTS, absolute_path, run_dir_problems

log = logging.getLogger(__name__)
SHIPPED = (None, "shipped")  # heads_path / drafter_path values that name no file


class PreflightError(ValueError):
    """A run's inputs have problems; its message lists every one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        if len(problems) == 1:
            super().__init__(f"the run cannot start: {problems[0]}")
        else:
            super().__init__(f"the run cannot start ({len(problems)} problems):\n  - " + "\n  - ".join(problems))


class CheckedInputs(NamedTuple):
    """What `preflight` hands the driver."""

    cfg: TrainConfig  # run_dir and the local paths the config names, made absolute
    problems: list[Problem]  # the problem set, less the prompts data.long_prompts=drop left out


def preflight(cfg: TrainConfig) -> CheckedInputs:
    """The run's inputs, checked; raises `PreflightError` listing every problem found."""
    cfg = with_absolute_paths(cfg)
    run_dir = Path(cfg.run_dir)
    found = run_dir_problems(run_dir, run_dir / CHECKPOINTS)
    problems = read_problems(cfg, found)
    context = model_context(cfg, found)
    # A real model's tokenizer comes from model.name too: one that cannot be read is named once.
    tokenizer = read_tokenizer(cfg, found) if context is not None or cfg.model.tiny_type is not None else None
    if problems and context is not None and tokenizer is not None:
        problems = fitting_problems(cfg, problems, tokenizer, context, found)
    check_memory(cfg, found)
    if found:
        raise PreflightError(found)
    return CheckedInputs(cfg, problems)


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with run_dir, and each path it names that exists here, absolute: every actor, on every
    node and in whatever working directory, then means the same files; a name that exists nowhere
    here stays as written (a hub name)."""
    def local(path: str | None) -> str | None:
        if path is None or path in SHIPPED or not Path(path).expanduser().exists():
            return path
        return str(absolute_path(path))

    data = replace(cfg.data, path=local(cfg.data.path))
    rollout = replace(cfg.rollout,
                      speculation=replace(cfg.rollout.speculation, heads_path=local(cfg.rollout.speculation.heads_path)),
                      fastgrpo=replace(cfg.rollout.fastgrpo, drafter_path=local(cfg.rollout.fastgrpo.drafter_path)))
    resume = cfg.resume if cfg.resume in RESUME_MODES else local(cfg.resume)
    cache_dir = cfg.model.cache_dir and str(absolute_path(cfg.model.cache_dir))  # it need not exist yet
    return replace(cfg, run_dir=str(absolute_path(cfg.run_dir)), data=data, rollout=rollout, resume=resume,
                   model=replace(cfg.model, cache_dir=cache_dir))


def read_problems(cfg: TrainConfig, found: list[str]) -> list[Problem]:
    """The problem set, or [] with what is wrong with it added to `found`."""
    data = cfg.data
    try:
        return load_problems(data.name, data.path, data.split, data.limit, data.synthetic, records=data.records,
                             subset=data.subset)
    except (ValueError, OSError) as error:  # OSError: a file unreadable (permissions) or vanished
        found.append(f"{'data.path' if data.name != 'synthetic' else 'data'}: {error}")
        return []


def model_context(cfg: TrainConfig, found: list[str]) -> int | None:
    """The model's context in tokens (its config alone), with the limits it sets checked; None
    (and the problem in `found`) when it cannot be read."""
    try:
        context = cfg.model.context_length()
    except (ValueError, OSError) as error:
        found.append(f"model.name: {error}")
        return None
    try:
        validate_against_model(cfg, context)
    except ValueError as error:
        found.append(str(error))
    return context


def read_tokenizer(cfg: TrainConfig, found: list[str]):
    """The run's tokenizer (no weights), or None with the problem in `found`."""
    where = "model.name" if cfg.model.tiny_type is None else "model.tokenizer"
    try:
        return cfg.model.load_tokenizer()
    except (ValueError, OSError) as error:
        found.append(f"{where}: {error}")
        return None


def fitting_problems(cfg: TrainConfig, problems: list[Problem], tokenizer, context: int,
                     found: list[str]) -> list[Problem]:
    """The problems whose prompt leaves room for a whole response; by `data.long_prompts`, a
    longer one is a problem added to `found` (fail) or is left out with a count logged (drop)."""
    budget, limit = token_budget(cfg, context)
    max_new = cfg.rollout.max_new_tokens
    room = limit - max_new  # the longest prompt that leaves room for a whole response
    lengths = prompt_lengths(tokenizer, [p.question for p in problems], cfg.data.instruction)
    kept, long = split_long_prompts(problems, lengths, room, unnamed=f"{cfg.data.name} problem")
    if not long:
        return kept
    if cfg.data.long_prompts == "fail":
        first = long[0]
        found.append(f"{first.where}: its prompt has {first.tokens} tokens, and {first.tokens} + rollout.max_new_tokens "
                     f"({max_new}) > {budget}; {len(long)} of {len(problems)} prompts are that long "
                     "(data.long_prompts=fail; drop leaves them out of the run)")
    elif not kept:
        found.append(f"data.long_prompts=drop leaves no problem: all {len(problems)} prompts are longer than {room} "
                     f"tokens, the room {budget} leaves beside rollout.max_new_tokens ({max_new})")
    else:
        longest = max(long, key=lambda p: p.tokens)
        log.warning("data.long_prompts=drop: left out %d of %d problems, whose prompt is longer than %d tokens "
                    "(%s less rollout.max_new_tokens (%d)); the longest: %s, %d tokens",
                    len(long), len(problems), room, budget, max_new, longest.where, longest.tokens)
    return kept


def check_memory(cfg: TrainConfig, found: list[str]) -> None:
    """Add to `found` why the run's actors do not fit `cluster.gpu_memory_gb`, and what fixes it."""
    try:
        problem = check_fits(cfg)
    except (ValueError, OSError) as error:
        problem = f"the memory plan cannot read model.name's architecture: {error}"
    if problem:
        found.append(f"cluster.gpu_memory_gb: {problem}")


def token_budget(cfg: TrainConfig, context: int) -> tuple[str, int]:
    """`(what bounds a prompt and its response, that bound in tokens)`: learner.max_seq_len or the context."""
    if cfg.learner.max_seq_len <= context:
        return f"learner.max_seq_len ({cfg.learner.max_seq_len})", cfg.learner.max_seq_len
    return f"the context of model.name {cfg.model.name!r} ({context})", context

