"""Our policy loss and its gradient against TRL's own code (``trl==1.16.0``, a pinned test dependency).

TRL's loss is `GRPOTrainer._compute_loss`, run unbound on a holder of the attributes it reads: the
model's forward (`_get_per_token_logps_and_entropies`) hands back our random log-probs and
entropies, so both losses see the same numbers and their gradients are taken w.r.t. the same leaf.
TRL computes the mismatch weights inline in `_generate_and_score_completions`; that block of its
source is executed as it stands (`trl_mismatch_weights`). Batches have ragged padding (finite
junk under the mask), truncated responses and a zero-advantage group.

Our aggregations are TRL's loss types: "token-mean" is "dapo" ("cispo" for CISPO), "seq-mean-
token-mean" is "grpo", "seq-mean-token-sum" is "luspo" (TRL offers CISPO with its token
normalisation only). Where we differ on purpose:

- TRL's sequence means divide by every row, ours by the rows with a valid token (aggregation.py):
  with truncated responses masked the test rescales TRL's loss by rows / non-empty rows.
- TRL multiplies the KL term by the ratio by default (`use_bias_correction_kl`); ours does not,
  so TRL runs with it off. TRL's KL is k3, ours' default.
- Our `dual_clip` is TRL's `delta` (INTELLECT-2's upper bound on the ratio): for a bound above
  1 + clip_high both give the same per-token loss.
- The entropy quantile is taken over one call's valid tokens in both; TRL gathers them across
  data-parallel ranks, our learner takes each rank's micro-batch.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from trl import GRPOTrainer
from trl.rewards import get_soft_overlong_punishment

from specroll.grpo import PolicyLossConfig, policy_loss, soft_overlong_penalty, valid_token_mask

TRL_LOSS_TYPE = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum": "luspo"}
B, T, GROUP = 8, 7, 4


def random_batch(seed: int) -> dict[str, torch.Tensor]:
    """Two groups of 4: ragged lengths, two truncated responses, the second group's rewards equal."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 7, 2, 4])
    mask = torch.arange(T)[None] < lengths[:, None]
    logp_old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp_new = logp_old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.cat([torch.randn(GROUP, generator=g, dtype=torch.float64), torch.zeros(GROUP, dtype=torch.float64)])
    return {
        "mask": mask,
        "logp_old": logp_old,
        "logp_new": logp_new,
        "logp_ref": logp_old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64),
        # The sampler's log-probs: the learner's off by bf16-sized noise, a few tokens far off.
        "logp_sampler": logp_old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
        + torch.where(torch.rand(B, T, generator=g) < 0.15, 1.5, 0.0).double(),
        "entropy": torch.rand(B, T, generator=g, dtype=torch.float64) * 4,
        "advantages": advantages,
        "truncated": torch.tensor([True, False, False, False, False, True, False, False]),
    }


def trl_mismatch_weights(trainer, completion_mask, old_per_token_logps, sampling_per_token_logps):
    """TRL's importance-sampling weights: the block of `_generate_and_score_completions` that
    computes them, executed from TRL's source."""
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, line in enumerate(source) if "per_token_logps_diff = (old_per_token_logps" in line) - 1
    end = next(i for i, line in enumerate(source) if "Compute the per-token log probabilities for the reference" in line)
    block = textwrap.dedent("\n".join(source[start:end]))
    scope = {"self": trainer, "torch": torch, "math": math, "completion_mask": completion_mask, "tool_mask": None,
             "old_per_token_logps": old_per_token_logps, "sampling_per_token_logps": sampling_per_token_logps}
    exec(compile(block, "trl-grpo-trainer-mismatch-block", "exec"), scope)
    return scope["vllm_importance_sampling_ratio"]


def trl_loss(batch: dict, logp_new: torch.Tensor, cfg: PolicyLossConfig) -> torch.Tensor:
    """TRL's `_compute_loss` for `cfg` on `batch`, differentiable in `logp_new`."""
    completion_mask = batch["mask"].long()
    if cfg.mask_truncated:  # TRL's mask_truncated_completions zeroes their completion mask
        completion_mask = completion_mask * (~batch["truncated"]).long()[:, None]
    trainer = SimpleNamespace(
        accelerator=Accelerator(cpu=True),
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(delta=cfg.dual_clip, use_bias_correction_kl=False, steps_per_generation=1),
        loss_type="cispo" if cfg.surrogate == "cispo" else TRL_LOSS_TYPE[cfg.aggregation],
        importance_sampling_level=cfg.importance_sampling_level,
        epsilon_low=cfg.clip_low,
        epsilon_high=cfg.cispo_weight_max if cfg.surrogate == "cispo" else cfg.clip_high,
        beta=cfg.kl_coef,
        top_entropy_quantile=cfg.top_entropy_quantile,
        use_vllm=cfg.mismatch_correction is not None,
        vllm_importance_sampling_correction=cfg.mismatch_correction is not None,
        vllm_importance_sampling_mode=cfg.mismatch_correction,
        vllm_importance_sampling_clip_max=cfg.mismatch_weight_max,
        vllm_importance_sampling_clip_min=cfg.mismatch_weight_min,
        off_policy_mask_threshold=None,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logp_new, batch["entropy"], None),
    )
    trainer.get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask.__get__(trainer)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": completion_mask,
        "advantages": batch["advantages"],
        "old_per_token_logps": batch["logp_old"],
        "ref_per_token_logps": batch["logp_ref"],
        "num_items_in_batch": completion_mask.sum(),
    }
    if cfg.mismatch_correction is not None:
        inputs["importance_sampling_ratio"] = trl_mismatch_weights(
            trainer, completion_mask, batch["logp_old"], batch["logp_sampler"])
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    if cfg.aggregation != "token-mean":  # TRL's sequence means count every row, ours the non-empty ones
        loss = loss * B / int(completion_mask.any(dim=-1).sum())
    return loss


def our_loss(batch: dict, logp_new: torch.Tensor, cfg: PolicyLossConfig) -> torch.Tensor:
    loss, _ = policy_loss(logp_new, batch["logp_old"], batch["advantages"], batch["mask"], cfg,
                          logp_ref=batch["logp_ref"], truncated=batch["truncated"],
                          logp_sampler=batch["logp_sampler"], entropy=batch["entropy"])
    return loss


AGGREGATIONS = tuple(TRL_LOSS_TYPE)
# Each variant alone, then composed as TRL composes them; every one in each aggregation TRL offers for it.
VARIANTS = {
    "grpo": {},
    "grpo-dual-clip-kl": {"dual_clip": 3.0, "kl_coef": 0.05},
    "gspo": {"importance_sampling_level": "sequence", "clip_low": 0.2, "clip_high": 0.15},
    "gspo-kl-masked-truncated": {"importance_sampling_level": "sequence", "clip_low": 0.2, "clip_high": 0.15,
                                 "kl_coef": 0.05, "mask_truncated": True},
    "entropy-top-0.2": {"top_entropy_quantile": 0.2},
    "entropy-top-0.1": {"top_entropy_quantile": 0.1, "mask_truncated": True},
    "token-truncate": {"mismatch_correction": "token_truncate", "mismatch_weight_max": 2.0},
    "token-mask": {"mismatch_correction": "token_mask", "mismatch_weight_max": 2.0, "mismatch_weight_min": 0.5},
    "sequence-truncate": {"mismatch_correction": "sequence_truncate", "mismatch_weight_max": 3.0,
                          "mismatch_weight_min": 0.5},
    "sequence-mask": {"mismatch_correction": "sequence_mask", "mismatch_weight_max": 3.0},
    "gspo-entropy-mismatch-kl": {"importance_sampling_level": "sequence", "clip_low": 0.2, "clip_high": 0.15,
                                 "top_entropy_quantile": 0.5, "mismatch_correction": "token_truncate",
                                 "kl_coef": 0.05, "mask_truncated": True, "dual_clip": 2.0},
}
CISPO_VARIANTS = {
    "cispo": {"surrogate": "cispo", "cispo_weight_max": 1.2},
    "cispo-sequence": {"surrogate": "cispo", "cispo_weight_max": 1.05, "importance_sampling_level": "sequence"},
    "cispo-entropy-mismatch-kl": {"surrogate": "cispo", "cispo_weight_max": 1.2, "top_entropy_quantile": 0.3,
                                  "mismatch_correction": "sequence_mask", "mismatch_weight_max": 3.0,
                                  "kl_coef": 0.05, "mask_truncated": True},
}
CASES = [(name, dict(fields, aggregation=agg)) for name, fields in VARIANTS.items() for agg in AGGREGATIONS] + [
    (name, dict(fields, aggregation="token-mean")) for name, fields in CISPO_VARIANTS.items()]


@pytest.mark.parametrize(("name", "fields"), CASES, ids=[f"{n}-{f['aggregation']}" for n, f in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradient_equal_trl(name, fields, seed):
    batch = random_batch(seed)
    cfg = PolicyLossConfig(**fields)
    ours_new = batch["logp_new"].clone().requires_grad_()
    trl_new = batch["logp_new"].clone().requires_grad_()
    ours, trls = our_loss(batch, ours_new, cfg), trl_loss(batch, trl_new, cfg)
    (our_grad,), (trl_grad,) = torch.autograd.grad(ours, ours_new), torch.autograd.grad(trls, trl_new)
    valid = valid_token_mask(batch["mask"], batch["truncated"], cfg.mask_truncated)
    assert our_grad[~valid].abs().max() == 0
    assert our_grad.abs().max() > 0, "a case without gradient compares nothing"
    torch.testing.assert_close(ours, trls.to(ours.dtype), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(our_grad * valid, trl_grad * valid, rtol=1e-9, atol=1e-12)


def test_cases_clip_truncate_and_mask_something():
    """The bounds above are chosen so each variant's mechanism acts on these batches."""
    batch = random_batch(0)
    metrics = {}
    for name, fields in [("gspo", VARIANTS["gspo"]), ("cispo", CISPO_VARIANTS["cispo"]),
                         ("token-mask", VARIANTS["token-mask"]), ("entropy", VARIANTS["entropy-top-0.2"])]:
        _, metrics[name] = policy_loss(batch["logp_new"], batch["logp_old"], batch["advantages"], batch["mask"],
                                       PolicyLossConfig(**fields), logp_sampler=batch["logp_sampler"],
                                       entropy=batch["entropy"])
    gspo = metrics["gspo"]
    assert 0 < gspo["clip_frac_low"] + gspo["clip_frac_high"] < 1
    assert 0 < metrics["cispo"]["cispo_clip_frac"] < 1
    assert 0 < metrics["token-mask"]["is_clipped_frac"] < 1
    assert metrics["entropy"]["entropy_mask_frac"] == pytest.approx(7 / 35)  # top 20% of 35 tokens


@pytest.mark.parametrize("max_len, buffer_len", [(20, 5), (16, 16), (8, 1)])
def test_soft_overlong_penalty_equals_trl(max_len, buffer_len):
    lengths = list(range(0, max_len + 4))
    theirs = get_soft_overlong_punishment(max_len, buffer_len)([[1] * n for n in lengths])
    ours = soft_overlong_penalty(torch.tensor(lengths), max_len, buffer_len)
    torch.testing.assert_close(ours, torch.tensor(theirs, dtype=torch.float32))
