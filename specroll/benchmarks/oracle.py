"""The oracle bound on tokens per verify pass, shared by the speculative benchmarks.

What a drafter knowing the policy's exact next-token distributions along the sampled responses
would get with the same per-step node budgets: the best-N tree from those distributions, with
siblings off the sampled path treated as leaves since their own children are unknown. With
coupled draws every drafter decodes these same responses, so the bound holds for each of them.
"""
from __future__ import annotations

import torch

from ..rollout import SamplingParams, sampling_logprobs

ORACLE_TOP = 64  # sibling candidates considered per position

# Per response with at least two tokens: the policy's probability of each sampled token r_j
# (realised [L]) and its ORACLE_TOP largest probabilities at that position (top [L, ORACLE_TOP]).
Probabilities = list[tuple[torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def response_probabilities(model, prompts: list[list[int]], responses: list[list[int]],
                           params: SamplingParams) -> Probabilities:
    """What the oracle knows of `responses` (row r answers prompts[r // params.n])."""
    device = next(model.parameters()).device
    out = []
    for row, response in enumerate(responses):
        prompt = prompts[row // params.n]
        if len(response) < 2:
            continue
        ids = torch.tensor([prompt + response], device=device)
        logp = sampling_logprobs(model(ids).logits[0, len(prompt) - 1 : -1], params).float()  # P_j for r_j
        # On the CPU: the walk reads single elements thousands of times (a sync each on a GPU).
        realised = logp.gather(1, torch.tensor(response, device=logp.device)[:, None]).squeeze(1).exp().cpu()
        top = logp.topk(min(ORACLE_TOP, logp.shape[1]), dim=1).values.exp().cpu()
        out.append((realised, top))
    return out


def oracle_passes(probabilities: Probabilities, budgets: list[int], max_depth: int) -> tuple[int, int]:
    """(tokens emitted, verify passes) of a perfect drafter whose k-th pass of each response has
    budgets[k] nodes (the last budget repeats); the first token, from the prompt's pass, is not counted."""
    emitted, passes = 0, 0
    for realised, top in probabilities:
        i, step = 0, 0  # root = r_i (already emitted); the tree predicts r_{i+1} ...
        while i < len(realised) - 1:
            n = budgets[min(step, len(budgets) - 1)]
            accepted = oracle_accepted(realised, top, i, n - 1, max_depth)
            emitted += accepted + 1
            passes += 1
            i += accepted + 1
            step += 1
    return emitted, passes


def oracle_tokens_per_step(model, prompts, out, params: SamplingParams, budgets: list[int], max_depth: int) -> float:
    """Tokens per verify step of a perfect drafter under a generate call's per-step budgets."""
    emitted, passes = oracle_passes(response_probabilities(model, prompts, out.token_ids, params), budgets, max_depth)
    return emitted / max(passes, 1)


def oracle_accepted(realised: torch.Tensor, top: torch.Tensor, i: int, drafts: int, max_depth: int) -> int:
    """How many on-path nodes a best-`drafts` tree built from exact probabilities contains.

    A node ranks behind its ancestors and behind the siblings of its path that score higher;
    the siblings' own descendants (and siblings beyond ORACLE_TOP) are not counted, so this
    errs high: a ceiling, as a bound should."""
    chain = 1.0
    for d in range(1, min(max_depth, len(realised) - 1 - i) + 1):
        chain_d = chain * float(realised[i + d])
        # Candidates ranked above node d: its d-1 ancestors plus siblings that score higher.
        better = d - 1
        ancestor = 1.0
        for e in range(1, d + 1):
            threshold = chain_d / ancestor
            probs = top[i + e]
            count = int((probs > threshold).sum())
            if float(realised[i + e]) > threshold:
                count -= 1  # the on-path token itself is not a sibling
            better += count
            ancestor *= float(realised[i + e])
        if better >= drafts:
            return d - 1
        chain = chain_d
    return min(max_depth, len(realised) - 1 - i)
