"""Statistical exactness of speculative sampling, token by token (docs/algorithm.md, section 2).

Every token a speculative rollout emits must be a sample of the policy's distribution given
its true prefix. We record, for every decision of every verify step, which response and
position it emitted, at which depth of its step, and which tokens the tree drafted below the
node it was made at; the exact conditional distribution comes from a reference independent
of the code under test (transformers' forward of the same weights and `reference_probs`
below). Under exactness, each decision's token is a fresh draw from that conditional given
everything before it, so pooled statistics of many decisions have known null distributions
(martingale central limit theorem), whatever the trees were and however the decisions were
grouped by what was known before them (depth in the step, drafted mass).

Three tests per group of decisions, each an approximately chi-square statistic:
- acceptance calibration: how often the token was one of the drafted children, against the
  exact probability of that (cells: depth x bin of that probability). For blind trees it is the
  drafted mass; trees that read their draws' noise hit more often, and their null is the exact
  chance given that noise (`gumbel_hit_chance`);
- token: counts of each token id against the summed exact probabilities;
- rank: counts of each rank under the exact distribution (rank 0 = most likely token).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from specroll.models import to_hf_state_dict
from specroll.rollout import RolloutEngine
from specroll.rollout.draw_noise import token_gumbels
from specroll.rollout.sampling import RowRandom, uniforms_at
from specroll.speculation.verification.verify import verify_tree


def tiered(names: Iterable[str], quick: set[str]) -> list:
    """Parameters of the settings `names`, sorted: those in `quick` run in every tier, the others
    are marked `statistics` (minutes of sampling, left out of make test-fast)."""
    return [pytest.param(name, marks=() if name in quick else pytest.mark.statistics) for name in sorted(names)]


# Cells whose expected variance is below this are left out: the normal approximation needs counts.
MIN_CELL_VARIANCE = 10.0
MASS_BINS = (0.0, 0.1, 0.3, 0.6, 0.9, 1.0)


def reference_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution plain sampling must draw from, written apart from `specroll.rollout.sampling`.

    float64; temperature, then top-k, then top-p on what top-k kept. Ties are explicit: top-k
    keeps every token whose logit equals the k-th largest; top-p keeps a token when the tokens
    strictly more likely than it hold less than `top_p` of the mass, so tied tokens are kept
    or dropped together.
    """
    z = np.asarray(logits, dtype=np.float64) / temperature
    if 0 < top_k < z.shape[-1]:
        kth = np.sort(z, axis=-1)[..., -top_k][..., None]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        above = (p[..., None, :] > p[..., :, None]) * p[..., None, :]  # [..., v, u]: p_u where p_u > p_v
        p = np.where(above.sum(axis=-1) < top_p, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def near_cutoff(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                tolerance: float = 1e-4) -> np.ndarray:
    """[N] rows where top-k or top-p keeps a token by a margin within `tolerance`: two correct
    implementations (float32 vs float64, other kernels) may keep different sets there, so the
    tests leave them out. Which rows those are depends only on the prefix, so the rest stay exact."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    near = np.zeros(z.shape[:-1], dtype=bool)
    if 0 < top_k < z.shape[-1]:
        s = np.sort(z, axis=-1)
        near |= s[..., -top_k] - s[..., -top_k - 1] < tolerance
    if top_p < 1.0:
        p = reference_probs(logits, temperature, top_k)
        above = ((p[..., None, :] > p[..., :, None]) * p[..., None, :]).sum(axis=-1)
        near |= (np.abs(above - top_p) < tolerance).any(axis=-1)
    return near


def assert_plain_responses(model, prompts: list[list[int]], out, params) -> None:
    """`out`'s responses are plain decoding's for the same params, token for token: each tree
    node samples with the draw plain sampling uses for the token it would emit (speculation/verification/verify.py).
    A float rounding difference between a tree pass and a plain step may fork a rare one."""
    plain = RolloutEngine(model).generate(prompts, params).token_ids
    same = sum(a == b for a, b in zip(plain, out.token_ids))
    assert same >= 0.999 * len(plain), f"{len(plain) - same} of {len(plain)} responses differ"


def hf_oracle(model):
    """transformers' model holding the same weights as our `model` (the reference forward)."""
    from transformers import AutoModelForCausalLM

    cfg = model.config
    hf = AutoModelForCausalLM.from_config(cfg.to_hf(), dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.state_dict(), cfg), strict=False)
    # A tied LM head is loaded as the embeddings.
    assert (missing, unexpected) == (["lm_head.weight"] if cfg.tie_word_embeddings else [], [])
    return hf.eval()


@torch.no_grad()
def teacher_forced_logits(hf, prompt: list[int], responses: list[list[int]]) -> list[np.ndarray]:
    """Per response, the logits [len(response), V] that predicted each of its tokens."""
    longest = max(len(r) for r in responses)
    ids = torch.zeros(len(responses), len(prompt) + longest, dtype=torch.long)
    ids[:, : len(prompt)] = torch.tensor(prompt)
    for i, r in enumerate(responses):
        ids[i, len(prompt) : len(prompt) + len(r)] = torch.tensor(r, dtype=torch.long)
    # Right padding is harmless: a causal model's earlier positions never see it.
    logits = hf(ids.to(hf.device)).logits[:, len(prompt) - 1 : -1].double().cpu().numpy()
    return [logits[i, : len(r)] for i, r in enumerate(responses)]


class DecisionRecorder:
    """Wraps a speculative engine's decoder `step`, acceptance rule and plain pass to record every decision.

    `rule` is the acceptance rule to run (the real `verify_tree`, or a test-only mutant).
    """

    def __init__(self, engine, prompt_lens: list[int], n: int, rule=verify_tree) -> None:
        self.engine, self.decoder, self.rule = engine, engine.decoder, rule
        decoder = engine.decoder
        self.prompt_lens = torch.tensor(prompt_lens, device="cpu").repeat_interleave(n)
        self.steps: list[tuple] = []
        self._step, self._rows = decoder.step, None
        decoder.step, decoder.verify = self.step, self.verify
        self._plain_pass = getattr(decoder, "plain_pass", None)  # SpecRoll's steps without a tree
        if self._plain_pass is not None:
            decoder.plain_pass = self.plain_pass

    def step(self, state):
        rows = state.row_ids.cpu()
        self._rows = (rows, state.history.lengths.cpu() - self.prompt_lens[rows])
        return self._step(state)

    def plain_pass(self, state):
        """A step without a tree (the plain decode step): one root decision per row, nothing drafted."""
        verdict = self._plain_pass(state)
        rows, emitted_before = self._rows
        none = torch.zeros(len(rows), 0, dtype=torch.long)
        self.steps.append((rows, emitted_before, none, none, none.bool(), verdict.path.cpu(), verdict.counts.cpu(),
                           verdict.tokens.cpu()))
        return verdict

    def verify(self, logprobs, tree, uniforms, params, max_depth):
        verdict = self.rule(logprobs, tree, uniforms, params, max_depth)
        rows, emitted_before = self._rows
        self.steps.append((rows, emitted_before, tree.tokens.cpu(), tree.parents.cpu(), tree.valid.cpu(),
                           verdict.path.cpu(), verdict.counts.cpu(), verdict.tokens.cpu()))
        return verdict


@dataclass
class Decisions:
    """Every kept token of a rollout, with what was known before it was drawn."""

    probs: np.ndarray  # [N, V] exact conditional distribution (the reference)
    tokens: np.ndarray  # [N] the emitted token
    depth: np.ndarray  # [N] decision depth in its verify step (0: the root's, or a plain step / prefill)
    drafted: np.ndarray  # [N, V] bool: tokens drafted as children of the node the decision was made at
    logprobs: np.ndarray  # [N] the log-prob the engine reported for the token
    response: np.ndarray  # [N] response index
    position: np.ndarray  # [N] index of the token in its response

    def select(self, rows: np.ndarray) -> "Decisions":
        return Decisions(**{name: value[rows] for name, value in vars(self).items()})


def collect_decisions(steps: list[tuple] | None, out, probs_per_response: list[np.ndarray]) -> Decisions:
    """Join a recorder's steps with the responses kept (tokens cut at EOS / the cap drop out).
    steps None: plain decoding, every token a depth-0 decision with nothing drafted."""
    lengths = np.array([len(t) for t in out.token_ids])
    offsets = np.concatenate(([0], lengths.cumsum()[:-1]))
    total, vocab = int(lengths.sum()), probs_per_response[0].shape[1]
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t in out.token_ids])
    depth = np.zeros(total, dtype=np.int64)  # the prefill token stays at depth 0
    drafted = np.zeros((total, vocab), dtype=bool)
    seen = np.full(total, steps is None)
    seen[offsets[lengths > 0]] = True
    for rows, before, tree_tokens, parents, valid, path, counts, emitted in steps or []:
        rows, before, counts = rows.numpy(), before.numpy(), counts.numpy()
        k = int(counts.max())
        d = np.arange(k)
        position = before[:, None] + d  # [B, k] index in the response of each decision's token
        kept = (d < counts[:, None]) & (position < lengths[rows][:, None])
        flat = (offsets[rows][:, None] + position)[kept]
        assert (emitted[:, :k].numpy()[kept] == tokens[flat]).all(), "recorded decisions out of step with the output"
        children = (parents.numpy()[:, None, :] == path[:, :k].numpy()[..., None]) & valid.numpy()[:, None, :]
        b, j, m = np.nonzero(children & kept[..., None])
        step_drafted = np.zeros((len(rows), k, vocab), dtype=bool)
        step_drafted[b, j, tree_tokens.numpy()[b, m]] = True
        depth[flat] = np.broadcast_to(d, kept.shape)[kept]
        drafted[flat] = step_drafted[kept]
        seen[flat] = True
    assert seen.all(), "a kept token was not seen by any recorded verify step"
    return Decisions(
        probs=np.concatenate(probs_per_response),
        tokens=tokens,
        depth=depth,
        drafted=drafted,
        logprobs=np.concatenate([np.asarray(lp, dtype=np.float64) for lp in out.logprobs]),
        response=np.repeat(np.arange(len(lengths)), lengths),
        position=np.concatenate([np.arange(n) for n in lengths]),
    )


def decisions_of(oracle, prompts: list[list[int]], out, recorder, params, n: int) -> Decisions:
    """Every kept token of a generate call on `prompts` (`n` responses each) with its reference
    distribution; rows near a top-k / top-p cut-off left out. recorder None: plain decoding."""
    logits = []
    for i, prompt in enumerate(prompts):
        logits += teacher_forced_logits(oracle, prompt, out.token_ids[i * n : (i + 1) * n])
    probs = [reference_probs(x, params.temperature, params.top_k, params.top_p) for x in logits]
    near = np.concatenate([near_cutoff(x, params.temperature, params.top_k, params.top_p) for x in logits])
    return collect_decisions(recorder and recorder.steps, out, probs).select(~near)


def multinomial_sum_test(observed: np.ndarray, probs: np.ndarray) -> float:
    """p-value that one-hot outcomes `observed` [N, C] are independent draws from `probs` [N, C].

    The statistic is the quadratic form of (counts - expected) in the exact covariance of a sum
    of non-identical multinomials (sum of diag(p) - p p^T); with identical rows it equals
    Pearson's chi-square. Categories with little expected variance are pooled into one; a count
    in a category of zero probability gives p = 0.
    """
    if (observed & (probs <= 0)).any():
        return 0.0
    variance = (probs * (1 - probs)).sum(axis=0)
    big = variance >= MIN_CELL_VARIANCE
    if big.sum() < 1:
        return 1.0
    obs = np.concatenate([observed[:, big], observed[:, ~big].sum(axis=1, keepdims=True)], axis=1).astype(float)
    prb = np.concatenate([probs[:, big], probs[:, ~big].sum(axis=1, keepdims=True)], axis=1)
    if (prb[:, -1] * (1 - prb[:, -1])).sum() < MIN_CELL_VARIANCE:  # too rare to stand alone: fold in
        obs = np.concatenate([obs[:, :-2], obs[:, -2:].sum(axis=1, keepdims=True)], axis=1)
        prb = np.concatenate([prb[:, :-2], prb[:, -2:].sum(axis=1, keepdims=True)], axis=1)
    if prb.shape[1] < 2:
        return 1.0
    diff = (obs - prb).sum(axis=0)[:-1]  # one category is determined by the others
    p = prb[:, :-1]
    cov = np.diag(p.sum(axis=0)) - p.T @ p
    stat = float(diff @ np.linalg.solve(cov, diff))
    return float(chi2.sf(stat, df=len(diff)))


def hits_and_chances(dec: Decisions, chance: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """[N] whether each decision's token was a drafted child, and the exact chance of that:
    `chance`, or where None the drafted mass (the chance for trees blind to the draws)."""
    hit = dec.drafted[np.arange(len(dec.tokens)), dec.tokens]
    return hit, (dec.probs * dec.drafted).sum(axis=1) if chance is None else chance


def acceptance_test(dec: Decisions, depth_groups: list[tuple[int, int]], chance: np.ndarray | None = None) -> float:
    """p-value that the drafted children were hit as often as the exact probabilities say, per
    cell of (decision depth group x bin of the chance of a hit, `hits_and_chances`): sum of
    squared z-scores, chi-square. A hit of chance 0 or a miss of chance 1 gives p = 0."""
    hit, mass = hits_and_chances(dec, chance)
    if (hit & (mass <= 0)).any() or (~hit & (mass >= 1)).any():
        return 0.0
    stat, cells = 0.0, 0
    for lo, hi in depth_groups:
        in_depth = (dec.depth >= lo) & (dec.depth <= hi)
        for a, b in zip(MASS_BINS[:-1], MASS_BINS[1:]):
            cell = in_depth & (mass > a) & (mass <= b)
            variance = (mass[cell] * (1 - mass[cell])).sum()
            if variance >= MIN_CELL_VARIANCE:
                stat += (hit[cell].sum() - mass[cell].sum()) ** 2 / variance
                cells += 1
    return float(chi2.sf(stat, df=cells)) if cells else 1.0


def pooled_acceptance_test(dec: Decisions, chance: np.ndarray | None = None) -> float:
    """Two-sided p-value that drafted children were hit as often as the exact probabilities say,
    over all decisions together: the test with the most power against a rule that accepts a
    little too often (or too rarely) everywhere."""
    hit, mass = hits_and_chances(dec, chance)
    variance = (mass * (1 - mass)).sum()
    if variance < MIN_CELL_VARIANCE:
        return 1.0
    return float(chi2.sf((hit.sum() - mass.sum()) ** 2 / variance, df=1))


def ranks(probs: np.ndarray) -> np.ndarray:
    """[N, V] rank of each token under its row's distribution (0: most likely; ties by token id)."""
    order = np.argsort(-probs, axis=1, kind="stable")
    out = np.empty_like(order)
    np.put_along_axis(out, order, np.arange(probs.shape[1])[None].repeat(len(probs), 0), axis=1)
    return out


def exactness_pvalues(dec: Decisions, max_depth: int, chance: np.ndarray | None = None) -> dict[str, float]:
    """Every test's p-value: acceptance calibration over all depths (against `chance`, see
    `hits_and_chances`), token and rank tests per depth (depth 0 includes plain steps and the
    prefill token)."""
    groups = [(d, d) for d in range(max_depth)] + [(max_depth, max_depth)]
    out = {"acceptance": acceptance_test(dec, groups, chance), "acceptance_pooled": pooled_acceptance_test(dec, chance)}
    n, vocab = dec.probs.shape
    onehot = np.zeros((n, vocab), dtype=bool)
    onehot[np.arange(n), dec.tokens] = True
    rank_of = ranks(dec.probs)
    rank_onehot = np.zeros_like(onehot)
    rank_onehot[np.arange(n), rank_of[np.arange(n), dec.tokens]] = True
    rank_probs = np.zeros_like(dec.probs)
    np.put_along_axis(rank_probs, rank_of, dec.probs, axis=1)
    for lo, hi in groups:
        sel = (dec.depth >= lo) & (dec.depth <= hi)
        if sel.sum() == 0:
            continue
        out[f"token@{lo}"] = multinomial_sum_test(onehot[sel], dec.probs[sel])
        out[f"rank@{lo}"] = multinomial_sum_test(rank_onehot[sel], rank_probs[sel])
    return out


def bonferroni_min(pvalues: dict[str, float]) -> float:
    """The smallest p-value times the number of tests (capped at 1): one figure for the family."""
    return min(1.0, min(pvalues.values()) * len(pvalues))


def decision_draws(dec: Decisions, seed: int, n: int) -> np.ndarray:
    """[N] the draw of each decision: its response's stream (prompt i's j-th response is row key
    (i, j), as the engine keys them) at the token's position."""
    keys = RowRandom(seed, [(r // n, r % n) for r in range(int(dec.response.max()) + 1)], "cpu").keys
    return uniforms_at(keys[dec.response], torch.as_tensor(dec.position)[:, None])[:, 0].numpy()


GUMBEL_TIE = 1e-4  # log-space gap below which float32 and float64 log-probs may pick different Gumbel winners


def gumbel_hit_chance(dec: Decisions, draws: np.ndarray, candidates: int) -> np.ndarray:
    """[N] the exact chance that each decision's token was a drafted child, given every token's
    Gumbel under its draw `draws` [N] (more than any tree reads), under the gumbel sampler with
    `candidates` tokens in its first stage: the argmax over the likeliest `candidates` (S) of
    log p + G with probability p(S), else a token outside S with probability p, whatever G. Where
    the two best of S are within GUMBEL_TIE, each is taken to win half the time."""
    n, vocab = dec.probs.shape
    noise = token_gumbels(torch.as_tensor(draws), torch.arange(vocab).expand(n, -1)).numpy()
    inside = np.zeros_like(dec.drafted)
    np.put_along_axis(inside, np.argsort(-dec.probs, axis=1, kind="stable")[:, :candidates], True, axis=1)
    with np.errstate(divide="ignore"):
        perturbed = np.where(inside, np.log(dec.probs) + noise, -np.inf)
    rows = np.arange(n)
    best, second = np.argsort(-perturbed, axis=1, kind="stable")[:, :2].T
    winner_drafted = dec.drafted[rows, best] * (dec.probs[rows, best] > 0)
    # The sampler's float32 log-probs cannot order two perturbed values this close: either may win.
    tied = perturbed[rows, best] - perturbed[rows, second] < GUMBEL_TIE
    winner_drafted = np.where(tied, (winner_drafted + dec.drafted[rows, second]) / 2, winner_drafted)
    return (dec.probs * inside).sum(axis=1) * winner_drafted + (dec.probs * dec.drafted * ~inside).sum(axis=1)
