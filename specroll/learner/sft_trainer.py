"""Supervised warm start: fine-tune the policy on reference worked solutions before GRPO.

Examples. Each is `format_prompt(tokenizer, question)` (the exact prompt the rollouts use),
then the solution text and the tokenizer's end-of-sequence token (SmolLM2's `<|im_end|>`,
where rollouts stop). The loss is the token NLL of the response only, averaged over every
response token of an optimizer step.

Packing. Examples are packed first-fit, in a per-epoch shuffled order, into rows of at most
`row_tokens` tokens, one row per forward. Inside a row a block-diagonal causal
`new_token_mask` keeps each example to its own tokens and positions restart at 0 for each
example, so a packed row's loss is exactly the sum of its examples' losses computed one by
one; a row carries no padding. Only the positions that predict a response token go through
the LM head.

Engine. The policy sits in the learner's DeepSpeed engine (`build_engine`: AdamW, gradient
clipping, warm-up then cosine decay). As in the GRPO learner, DeepSpeed runs with
`gradient_accumulation_steps=1` and the last row of a step marks the accumulation boundary,
because the number of rows per step varies. One process only (a 135M policy needs no more).

Precision. "bf16-autocast": float32 weights and AdamW, matmuls under `torch.autocast` in
bf16. "bfloat16": DeepSpeed's bf16 mode, bf16 weights with float32 master weights in the
optimizer. "float32": no bf16 at all. "auto" picks bf16-autocast where bf16 matmuls are
supported (CUDA with bf16; CPUs where oneDNN reports bf16, i.e. with AVX-512) and float32
elsewhere, where bf16 is emulated at many times float32's cost.

Evaluation. Before and after training, on held-out reference solutions (teacher forcing,
not the policy's own samples), over their response positions: mean NLL per token, mean
entropy of the next-token distribution at temperature 1, and mean top-1 probability. The
held-out problems are the last `eval_examples` of the dataset, never trained on; the eval
runs without autocast, in the weights' dtype.

Output. The command (`python -m specroll.tools.sft`) saves to `--out` a Hugging Face
directory (`export_hf`) that `load_causal_lm` and the rollout engine load, with
`sft_summary.json` beside the weights. It is staged and renamed, so `--out` is whole or
absent; a finished `--out` with the same recipe is reused, not redone.

Recipe (the command's defaults): AdamW lr 5e-5 (betas 0.9/0.999, no weight decay), linear warm-up
over the first 10% of steps, cosine decay to 10% of lr, gradient norm clipped at 1.0, 8192
tokens per optimizer step in rows of 1024, 2 epochs, seed 0, 64 held-out problems.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specroll.data import Problem, format_prompt
from specroll.grpo import entropy_from_logits
from specroll.models import CausalLM, resolve_device

from .checkpoint import export_hf
from .collectives import world_size
from .config import LearnerConfig, check_int
from .grpo_learner import build_engine

PRECISIONS = ("auto", "float32", "bf16-autocast", "bfloat16")
SUMMARY_FILE = "sft_summary.json"


@dataclass
class SFTConfig:
    """The SFT recipe; the defaults are the documented warm-start recipe."""

    lr: float = 5e-5
    """Peak AdamW learning rate."""

    warmup_ratio: float = 0.1
    """Fraction of the optimizer steps spent in linear warm-up, in [0, 1)."""

    min_lr_ratio: float = 0.1
    """The cosine decay ends at `min_lr_ratio * lr`, in [0, 1]."""

    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    epochs: int = 2
    """Passes over the training examples."""

    row_tokens: int = 1024
    """Length cap of one packed row (one forward); every example must fit in one row."""

    batch_tokens: int = 8192
    """Token budget of one optimizer step: `batch_tokens // row_tokens` packed rows."""

    eval_examples: int = 64
    """Held-out problems (the last ones of the dataset) for the before/after evaluation."""

    max_steps: int | None = None
    """Stop after this many optimizer steps (smoke runs); the schedule spans the steps run."""

    precision: str = "auto"
    """One of "auto", "float32", "bf16-autocast", "bfloat16" (see the module docstring)."""

    device: str = "auto"
    """"auto" (CUDA when present, else CPU), "cpu" or "cuda"."""

    seed: int = 0
    """Seeds the per-epoch shuffle that decides the packing."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first invalid field."""

        def number_in(name: str, value: Any, low: float, high: float, high_open: bool = False) -> None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or value < low or value > high or (high_open and value == high):
                raise ValueError(f"{name} must be a finite number in [{low}, {high}{')' if high_open else ']'}, got {value!r}")

        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        number_in("warmup_ratio", self.warmup_ratio, 0.0, 1.0, high_open=True)
        number_in("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        number_in("weight_decay", self.weight_decay, 0.0, math.inf)
        number_in("grad_clip", self.grad_clip, 0.0, math.inf)
        check_int("epochs", self.epochs)
        check_int("row_tokens", self.row_tokens)
        check_int("batch_tokens", self.batch_tokens)
        if self.batch_tokens < self.row_tokens:
            raise ValueError(f"batch_tokens ({self.batch_tokens}) must be >= row_tokens ({self.row_tokens})")
        check_int("eval_examples", self.eval_examples)
        if self.max_steps is not None:
            check_int("max_steps", self.max_steps)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.device != "auto" and str(self.device).split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:i]', got {self.device!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def rows_per_step(self) -> int:
        return self.batch_tokens // self.row_tokens


# -- examples and packing ---------------------------------------------------------------------

@dataclass(frozen=True)
class SFTExample:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def build_examples(tokenizer, problems: list[Problem]) -> list[SFTExample]:
    """Prompt as the rollouts see it; response = solution text + the end-of-sequence token."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id to end the responses with")
    return [
        SFTExample(
            tuple(format_prompt(tokenizer, p.question)),
            tuple(tokenizer(p.solution, add_special_tokens=False)["input_ids"]) + (tokenizer.eos_token_id,),
        )
        for p in problems
    ]


def pack_first_fit(lengths: list[int], order: list[int], row_tokens: int) -> list[list[int]]:
    """Indices (taken in `order`) grouped into rows of at most `row_tokens` tokens, first fit."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > row_tokens:
            raise ValueError(
                f"example {i} has {lengths[i]} tokens, more than row_tokens={row_tokens}; raise --row-tokens"
            )
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(row_tokens - lengths[i])
    return rows


def packed_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[T, T] bool, True = visible: causal inside each segment, nothing across segments."""
    same = segment_ids[:, None] == segment_ids[None, :]
    return same & torch.ones_like(same).tril()


@dataclass
class PackedRow:
    """Several examples concatenated into one sequence, with what makes the packing exact."""

    input_ids: torch.Tensor  # [T]
    position_ids: torch.Tensor  # [T], restarting at 0 for each example
    segment_ids: torch.Tensor  # [T], the example each token belongs to
    predict_at: torch.Tensor  # [K], positions whose next token is a response token
    targets: torch.Tensor  # [K], those response tokens

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_targets(self) -> int:
        return self.targets.numel()

    def to(self, device: torch.device) -> "PackedRow":
        return PackedRow(*(t.to(device) for t in (self.input_ids, self.position_ids, self.segment_ids, self.predict_at, self.targets)))


def pack_row(examples: list[SFTExample]) -> PackedRow:
    if not examples:
        raise ValueError("pack_row needs at least one example")
    ids, positions, segments, predict_at = [], [], [], []
    for segment, ex in enumerate(examples):
        start = len(ids)
        ids.extend(ex.prompt_ids + ex.response_ids)
        positions.extend(range(len(ex)))
        segments.extend([segment] * len(ex))
        # The last prompt token predicts the first response token, and so on.
        first = start + len(ex.prompt_ids) - 1
        predict_at.extend(range(first, first + len(ex.response_ids)))
    input_ids = torch.tensor(ids)
    predict_at_t = torch.tensor(predict_at)
    return PackedRow(input_ids, torch.tensor(positions), torch.tensor(segments), predict_at_t, input_ids[predict_at_t + 1])


def response_logits(model, row: PackedRow) -> torch.Tensor:
    """[K, V] float32 logits at the row's response-predicting positions (`model` may be an engine)."""
    out = model(
        row.input_ids[None],
        position_ids=row.position_ids[None],
        new_token_mask=packed_attention_mask(row.segment_ids)[None],
        logits_at=row.predict_at[None],
    )
    return out.logits[0].float()


def response_nll_sum(model, row: PackedRow) -> torch.Tensor:
    """Summed NLL of every response token in the row (0-dim, differentiable)."""
    return F.cross_entropy(response_logits(model, row), row.targets, reduction="sum")


def epoch_rows(examples: list[SFTExample], row_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(examples), generator=generator, device=generator.device).tolist()
    return pack_first_fit([len(e) for e in examples], order, row_tokens)


# -- evaluation ------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: CausalLM, examples: list[SFTExample], row_tokens: int) -> dict[str, float]:
    """Per response token of `examples`: mean NLL, next-token entropy and top-1 probability
    (temperature 1)."""
    device = next(model.parameters()).device
    sums = {"nll": 0.0, "entropy": 0.0, "top1_prob": 0.0}
    tokens = 0
    for indices in pack_first_fit([len(e) for e in examples], list(range(len(examples))), row_tokens):
        row = pack_row([examples[i] for i in indices]).to(device)
        logits = response_logits(model, row)
        k = row.num_targets
        sums["nll"] += float(F.cross_entropy(logits, row.targets, reduction="sum"))
        sums["entropy"] += float(entropy_from_logits(logits[None], torch.ones(1, k, dtype=torch.bool, device=device))) * k
        sums["top1_prob"] += float(logits.softmax(-1).amax(-1).sum())
        tokens += k
    return {**{key: value / tokens for key, value in sums.items()}, "tokens": tokens}


# -- training ----------------------------------------------------------------------------------

def resolve_precision(precision: str, device: torch.device) -> str:
    """"auto" -> bf16-autocast where bf16 matmuls are supported, else float32."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported()
    else:
        native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "bf16-autocast" if native else "float32"


def learner_config(cfg: SFTConfig, precision: str, total_steps: int) -> LearnerConfig:
    return LearnerConfig(
        dtype="bfloat16" if precision == "bfloat16" else "float32",
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        warmup_steps=int(cfg.warmup_ratio * total_steps),
        lr_schedule="cosine",
        min_lr_ratio=cfg.min_lr_ratio,
        total_steps=total_steps,
        grad_clip=cfg.grad_clip,
        device=cfg.device,
        seed=cfg.seed,
    )


@dataclass
class SFTResult:
    module: CausalLM  # the trained policy (the engine's module)
    metrics: dict[str, Any]


class TrainingPass(NamedTuple):
    losses: list[float]  # mean response NLL per token of each optimizer step
    tokens_seen: int  # tokens of every row trained on, prompts included
    seconds: float


def planned_steps(train: list[SFTExample], cfg: SFTConfig) -> list[list[list[int]]]:
    """Each optimizer step's packed rows of example indices, every epoch packed in its own
    shuffled order; decided up front, so the schedule knows the number of steps."""
    return [
        rows[start : start + cfg.rows_per_step]
        for epoch in range(cfg.epochs)
        for rows in [epoch_rows(train, cfg.row_tokens, cfg.seed, epoch)]
        for start in range(0, len(rows), cfg.rows_per_step)
    ][: cfg.max_steps]


def optimizer_step(engine, rows: list[PackedRow], autocast) -> float:
    """One optimizer step over `rows`, the loss normalised by all their response tokens; its mean NLL."""
    normalizer = sum(row.num_targets for row in rows)
    step_nll = 0.0
    for k, row in enumerate(rows):
        engine.set_gradient_accumulation_boundary(k == len(rows) - 1)
        with autocast:
            nll = response_nll_sum(engine, row)
        engine.backward(nll / normalizer, scale_wrt_gas=False)
        step_nll += float(nll.detach())
    engine.step()
    return step_nll / normalizer


def train_steps(engine, train: list[SFTExample], steps: list[list[list[int]]], autocast,
                progress: bool = True) -> TrainingPass:
    """Every planned step on the engine, with a progress bar of loss, learning rate and tokens/s."""
    losses: list[float] = []
    started = time.perf_counter()
    seen_tokens = 0
    bar = tqdm(total=len(steps), desc="sft", unit="step", disable=not progress, dynamic_ncols=True, mininterval=0)
    for step_rows in steps:
        rows = [pack_row([train[i] for i in indices]).to(engine.device) for indices in step_rows]
        lr = engine.get_lr()[0]
        losses.append(optimizer_step(engine, rows, autocast))
        seen_tokens += sum(row.num_tokens for row in rows)
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{lr:.2e}", tok_s=f"{seen_tokens / (time.perf_counter() - started):.0f}")
    bar.close()
    return TrainingPass(losses, seen_tokens, time.perf_counter() - started)


def train_sft(
    model: CausalLM,
    train: list[SFTExample],
    heldout: list[SFTExample],
    cfg: SFTConfig,
    progress: bool = True,
) -> SFTResult:
    """Fine-tune `model` (in place) on `train`; evaluate on `heldout` before and after."""
    if not train:
        raise ValueError("no training examples")
    if not heldout:
        raise ValueError("no held-out examples to evaluate on")
    if world_size() > 1:
        raise ValueError("SFT runs in one process; found a process group of several ranks")
    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    steps = planned_steps(train, cfg)
    engine = build_engine(model, learner_config(cfg, precision, len(steps)))
    module = engine.module
    autocast = (
        torch.autocast(engine.device.type, dtype=torch.bfloat16)
        if precision == "bf16-autocast"
        else contextlib.nullcontext()
    )
    before = evaluate(module, heldout, cfg.row_tokens)
    print(f"held-out before: {format_eval(before)}", flush=True)
    trained = train_steps(engine, train, steps, autocast, progress)
    after = evaluate(module, heldout, cfg.row_tokens)
    print(f"held-out after:  {format_eval(after)}", flush=True)
    return SFTResult(
        module=module,
        metrics={
            "precision": precision,
            "optimizer_steps": len(steps),
            "train_examples": len(train),
            "train_tokens_seen": trained.tokens_seen,
            "train_time_s": trained.seconds,
            "tokens_per_s": trained.tokens_seen / trained.seconds,
            "train_loss": trained.losses,
            "eval_before": before,
            "eval_after": after,
        },
    )


def format_eval(result: dict[str, float]) -> str:
    return (
        f"nll/token {result['nll']:.4f} | entropy {result['entropy']:.4f} nats | "
        f"top-1 prob {result['top1_prob']:.4f} | {result['tokens']} response tokens"
    )


# -- data selection and caching ---------------------------------------------------------

def split_problems(problems: list[Problem], eval_examples: int, limit: int | None,
                   skip: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out): the last `eval_examples` problems are held out; train is the first
    `limit` of the rest (all of it when None) after its first `skip`."""
    if not problems:
        raise ValueError("the dataset holds no problems")
    if len(problems) <= eval_examples:
        raise ValueError(
            f"the dataset holds {len(problems)} problems; more than eval_examples={eval_examples} "
            "are needed to hold some out and train on the rest"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"skip must be an int >= 0, got {skip!r}")
    rest, heldout = problems[:-eval_examples], problems[-eval_examples:]
    if skip >= len(rest):
        raise ValueError(f"skip={skip} leaves none of the {len(rest)} problems that are not held out to train on")
    return rest[skip:][:limit], heldout


def problems_digest(problems: list[Problem]) -> str:
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps([p.question, p.solution]).encode())
    return h.hexdigest()[:16]


def model_identity(name_or_path: str) -> str:
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if path.exists() else name_or_path


def default_out(model: str, dataset: str, limit: int | None, epochs: int) -> Path:
    from specroll.models.loading import cache_root

    name = Path(model).name if Path(model).expanduser().exists() else model.replace("/", "--")
    return cache_root() / "sft" / f"{name}-{dataset}{limit or 'all'}-e{epochs}"


def finished_summary(out: Path, recipe: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of a finished run in `out` for the same recipe; raise if `out` holds
    anything else (another recipe, a foreign directory), which this run would overwrite."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    summary_path = out / SUMMARY_FILE
    if not summary_path.is_file():
        raise FileExistsError(f"{out} exists and holds no {SUMMARY_FILE}; choose another --out or remove it")
    summary = json.loads(summary_path.read_text())
    if summary.get("recipe") != recipe:
        raise FileExistsError(
            f"{out} holds an SFT result for another recipe ({summary_path}); choose another --out or remove it"
        )
    return summary


def save_result(module: CausalLM, tokenizer, summary: dict[str, Any], out: Path) -> Path:
    """Export the policy and its summary to `out`, through a staging directory renamed at the
    end, so `out` is whole or absent."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    staging = out.with_name(out.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    export_hf(module, module.config, tokenizer, staging)
    (staging / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    os.replace(staging, out)
    return out
