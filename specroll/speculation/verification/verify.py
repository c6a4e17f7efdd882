"""Exact tree verification by sample-and-match (docs/algorithm.md, section 2).

At every node v of the tree the policy's distribution p_v (after the same temperature /
top-k / top-p processing as plain sampling) gives one independent sample y_v. From the root,
while y_v equals a drafted child of v, move to that child. Emit the accepted children and
finally y of the last node reached (the bonus token). Every emitted token is a sample of p
given its true prefix, whatever the drafts were, so responses are distributed exactly as
plain sampling.

Each node's sample uses the uniform plain sampling would use for the token the node emits: the
draw of its row's stream `depth` places ahead (`RowRandom.peek`), and the pass then advances the
stream by the tokens it emitted. Nodes of one depth share a draw, and that stays exact: which
node of depth d is reached depends only on the draws of depths < d, and the draws of nodes
beyond the last one reached decide nothing, so the next pass may use them afresh. A speculative
response is then the plain one for the same seed, token for token (up to float rounding of the
logits), whatever was drafted: modes and drafters compare on the same responses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specroll.rollout.decode_state import StepResult
from specroll.rollout.samplers import sample_tokens
from specroll.rollout.sampling import SamplingParams

from ..drafting.tree import DraftTree


@dataclass
class Verdict:
    path: torch.Tensor  # [B, H+1] combined node indices root..last accepted (padded with the last)
    counts: torch.Tensor  # [B] emitted tokens = accepted drafts + 1 (the bonus)
    tokens: torch.Tensor  # [B, H+1] emitted tokens (first `counts` are real)
    logprobs: torch.Tensor  # [B, H+1] their log-probabilities under the policy
    accepted_at_depth: torch.Tensor  # [B, H] whether depth d+1 was accepted
    reached_node_prob: torch.Tensor  # [B, H] head probability mass drafted below the node at depth d

    @classmethod
    def of_plain_step(cls, step: StepResult) -> Verdict:
        """The verdict of a plain step: its one token per row, no draft accepted."""
        batch, device = step.tokens.shape[0], step.tokens.device
        nothing = torch.zeros(batch, 0, device=device)
        return cls(path=torch.zeros(batch, 1, dtype=torch.long, device=device), counts=step.counts,
                   tokens=step.tokens, logprobs=step.logprobs, accepted_at_depth=nothing.bool(),
                   reached_node_prob=nothing)


def verify_tree(logprobs: torch.Tensor, tree: DraftTree, uniforms: torch.Tensor | None, params: SamplingParams,
                max_depth: int) -> Verdict:
    """logprobs [B, 1+M, V] at root and nodes; uniforms [B, 1+M] (one draw per node: see above),
    sampled as plain decoding samples with `params`."""
    samples, sample_lp = sample_tokens(logprobs, uniforms, params)  # [B, 1+M]
    batch = samples.shape[0]
    device = samples.device
    current = torch.zeros(batch, dtype=torch.long, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    path = [current]
    accepted, drafted_mass = [], []
    # Head probability mass of each node's drafted children: a calibration signal.
    child_mass = torch.zeros(batch, tree.num_drafts + 1, device=device)
    child_mass.scatter_add_(1, tree.parents, tree.head_probs.float() * tree.valid)
    for _ in range(max_depth if tree.num_drafts else 0):
        wanted = torch.gather(samples, 1, current[:, None])
        match = (tree.parents == current[:, None]) & (tree.tokens == wanted) & tree.valid & alive[:, None]
        moved = match.any(dim=1)
        drafted_mass.append(torch.where(alive, torch.gather(child_mass, 1, current[:, None]).squeeze(1), 0.0))
        accepted.append(moved)
        # Children carry distinct tokens, so at most one matches.
        current = torch.where(moved, match.int().argmax(dim=1) + 1, current)
        alive &= moved
        path.append(current)
    path_t = torch.stack(path, dim=1)
    accepted_t = torch.stack(accepted, dim=1) if accepted else torch.zeros(batch, 0, dtype=torch.bool, device=device)
    mass_t = torch.stack(drafted_mass, dim=1) if drafted_mass else torch.zeros(batch, 0, device=device)
    return Verdict(
        path=path_t,
        counts=accepted_t.sum(dim=1) + 1,
        tokens=torch.gather(samples, 1, path_t),
        logprobs=torch.gather(sample_lp, 1, path_t),
        accepted_at_depth=accepted_t,
        reached_node_prob=mass_t,
    )
