"""How far the sampler's log-probs are from the learner's on the same responses, by dtype.

Rollouts report the log-prob of each token under the distribution it was sampled from; the
learner recomputes it with a full-sequence forward (`sequence_logprobs`). Equal weights in
exact arithmetic give equal numbers; in bf16 they differ, and that mismatch is what
`train/approx_kl` sees at the first update of a step (the k3 estimate of KL(sampler ||
learner), token mean). This measures it for rollout / learner dtype pairs on the same weights,
and what `learner.loss.mismatch_correction` would make of it at the default bound 3: the share of
tokens (token modes) and of responses (sequence modes) whose weight pi_learner / pi_sampler falls
outside [1/3, 3], and the range of the per-response weight.

    python -m specroll.benchmarks.logprob_mismatch --prompts 8 --n 4 --max-new-tokens 64 --json out.json
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from ..grpo import kl_estimate, mismatch_weights
from ..learner.logprobs import sequence_logprobs
from ..models import build_tiny_model, load_causal_lm
from ..rollout import RolloutEngine, SamplingParams
from .engine_vs_hf import DEFAULT_GSM8K, load_prompts

PAIRS = (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16"))  # (rollout, learner)
WEIGHT_BOUND = 3.0  # the default `mismatch_weight_max`; 1 / it as the lower bound


@torch.no_grad()
def mismatch(model_fp32, prompts: list[list[int]], params: SamplingParams, rollout: str, learner: str) -> dict:
    """Sample with a `rollout`-dtype copy, score with a `learner`-dtype copy of the same weights."""
    sampler = RolloutEngine(copy_as(model_fp32, rollout))
    out = sampler.generate(prompts, params)
    scorer = copy_as(model_fp32, learner).eval()
    rows = [prompts[i // params.n] + out.token_ids[i] for i in range(len(out.token_ids))]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    prompt_lens = torch.tensor([len(prompts[i // params.n]) for i in range(len(rows))])
    response_lens = torch.tensor([len(t) for t in out.token_ids])
    learned = sequence_logprobs(scorer, ids, prompt_lens, response_lens, params.temperature)
    sampled = torch.zeros_like(learned.logprobs)
    for i, lp in enumerate(out.logprobs):
        sampled[i, : len(lp)] = torch.tensor(lp)
    mask = learned.mask
    k3 = kl_estimate(sampled, learned.logprobs, "k3")[mask]
    diff = (learned.logprobs - sampled)[mask].abs()
    bounds = (1 / WEIGHT_BOUND, WEIGHT_BOUND)
    _, token_outside = mismatch_weights(learned.logprobs, sampled, mask, "token_mask", *bounds)
    sequence, _ = mismatch_weights(learned.logprobs, sampled, mask, "sequence_mask", None, None)
    _, sequence_outside = mismatch_weights(learned.logprobs, sampled, mask, "sequence_mask", *bounds)
    return {"rollout": rollout, "learner": learner, "tokens": int(mask.sum()), "approx_kl": float(k3.mean()),
            "mean_abs_logprob_diff": float(diff.mean()), "max_abs_logprob_diff": float(diff.max()),
            "token_weight_outside_frac": float(token_outside[mask].float().mean()),
            "sequence_weight_outside_frac": float(sequence_outside[:, 0].float().mean()),
            "sequence_weight_min": float(sequence[:, 0].min()), "sequence_weight_max": float(sequence[:, 0].max())}


def copy_as(model, dtype: str):
    return copy.deepcopy(model).to(getattr(torch, dtype))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="smollm2-135m-instruct", help="alias or HF directory; 'tiny' for a test run")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.policy == "tiny":
        model = build_tiny_model("llama", seed=0, init_std=0.2, eos_token_ids=[1])
        prompts = [[5 + i, 9, 13] for i in range(args.prompts)]
    else:
        model, tokenizer = load_causal_lm(args.policy, dtype="float32", device="cpu")
        prompts, _ = load_prompts(tokenizer, args.prompts, DEFAULT_GSM8K)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, n=args.n, seed=args.seed)
    rows = [mismatch(model, prompts, params, rollout, learner) for rollout, learner in PAIRS]
    print(f"{args.policy}: {args.prompts} prompts x {args.n} responses x <= {args.max_new_tokens} tokens, T=1")
    print(f"{'rollout':>9} {'learner':>9} {'tokens':>7} {'approx_kl (k3)':>15} {'mean |dlogp|':>13} {'max |dlogp|':>12}"
          f" {'tok w out':>10} {'seq w out':>10} {'seq w range':>17}")
    for r in rows:
        print(f"{r['rollout']:>9} {r['learner']:>9} {r['tokens']:>7} {r['approx_kl']:>15.2e} "
              f"{r['mean_abs_logprob_diff']:>13.2e} {r['max_abs_logprob_diff']:>12.2e}"
              f" {r['token_weight_outside_frac']:>10.2%} {r['sequence_weight_outside_frac']:>10.2%}"
              f" {r['sequence_weight_min']:>8.4f}-{r['sequence_weight_max']:<8.4f}")
    result = {"policy": args.policy, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
