"""Draft records that mature in a verify pass: the heads' proposal at a node meets the policy there.

While drafting, each depth keeps a sketch of head k's distribution over the children of every
frontier node (`drafting.tree.Proposal`: top-m log-probs and ids). The verify pass then gives the policy's
distribution at every tree node. Along a row's accepted path (the root, the accepted nodes and
the last reached one) the node at depth j was drafted from by head j + 1 whenever it was on
that depth's frontier: that proposal and the policy's distribution there form a matured
record, which both Reflex (speculation/adaptation/reflex.py) and the slow path (speculation/adaptation/head_records.py) learn from.
Drafts beyond the accepted path were conditioned on tokens that did not happen, so they never
mature for Reflex, which corrects one trajectory. The pass still gave the policy's distribution
at those nodes, given their own paths: the slow path may learn from them too (`tree_proposals`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafting.tree import Proposal


@dataclass
class MaturedProposals:
    """R matured records of one verify pass, depth by depth."""

    row: torch.Tensor  # [R] batch row
    depth: torch.Tensor  # [R] j: the node's depth, so head j (0-based) proposed its children
    node: torch.Tensor  # [R] the node's combined index in the verify pass (0 = root)
    head_logp: torch.Tensor  # [R, m] the sketch's log-probs
    head_ids: torch.Tensor  # [R, m] its token ids
    children: torch.Tensor  # [R, M] tokens the tree drafted below the node (-1: none)


def matured_proposals(proposals: list[Proposal], tree, verdict) -> MaturedProposals:
    """The proposals met by verification along each row's accepted path (see the module docstring)."""
    batch, device = verdict.counts.shape[0], verdict.counts.device
    rows = torch.arange(batch, device=device)
    node_candidate = torch.cat((torch.full((batch, 1), -1, dtype=torch.long, device=device), tree.candidates), dim=1)
    parts = []
    for j, proposal in enumerate(proposals[: verdict.path.shape[1]]):
        node = verdict.path[:, j]  # [B] combined index of the accepted path's node at depth j
        match = proposal.parents == node_candidate.gather(1, node[:, None])  # [B, F]
        has = match.any(dim=1) & (j < verdict.counts)
        r, slot = rows[has], match.int().argmax(dim=1)[has]
        children = torch.where((tree.parents[r] == node[r, None]) & tree.valid[r], tree.tokens[r], -1)
        parts.append((r, torch.full_like(r, j), node[r], proposal.top_logp[r, slot], proposal.top_ids[r, slot], children))
    if not parts:
        none, none_2d = torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, 0, dtype=torch.long, device=device)
        return MaturedProposals(none, none, none, torch.zeros(0, 0, device=device), none_2d, none_2d)
    return MaturedProposals(*(torch.cat(x) for x in zip(*parts)))


def tree_proposals(proposals: list[Proposal], tree, verdict) -> tuple[MaturedProposals, torch.Tensor]:
    """Every proposal the verify pass met, on the accepted path or off it: a head's sketch at any
    valid tree node it drafted from, where the pass gave the policy's distribution conditioned on
    that node's own path. Also [R] bool: the record lies on the accepted path (only those have a
    realised token). The slow path may learn from these; Reflex keeps to the accepted path."""
    batch, device = verdict.counts.shape[0], verdict.counts.device
    node_candidate = torch.cat((torch.full((batch, 1), -1, dtype=torch.long, device=device), tree.candidates), dim=1)
    node_valid = torch.cat((torch.ones_like(tree.valid[:, :1]), tree.valid), dim=1)
    parts, on_path = [], []
    for j, proposal in enumerate(proposals):
        drafted_from = (proposal.parents[:, :, None] == node_candidate[:, None, :]) & node_valid[:, None, :]
        r, slot, node = drafted_from.nonzero(as_tuple=True)  # [B, F, 1+M] -> one entry per record
        children = torch.where((tree.parents[r] == node[:, None]) & tree.valid[r], tree.tokens[r], -1)
        parts.append((r, torch.full_like(r, j), node, proposal.top_logp[r, slot], proposal.top_ids[r, slot], children))
        path_node = verdict.path[r, min(j, verdict.path.shape[1] - 1)]
        on_path.append((j < verdict.counts[r]) & (j < verdict.path.shape[1]) & (path_node == node))
    if not parts:
        matured = matured_proposals([], tree, verdict)
        return matured, torch.zeros(0, dtype=torch.bool, device=device)
    return MaturedProposals(*(torch.cat(x) for x in zip(*parts))), torch.cat(on_path)


def node_paths(tree, roots: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 1+M, length] the tokens from the root to each verify-pass node, root first (x_{t+1},
    ...), zero-padded; a node deeper than `length` - 1 keeps its first `length`."""
    batch, m = tree.tokens.shape
    rows = torch.arange(batch, device=roots.device)
    paths = torch.zeros(batch, m + 1, length + m + 1, dtype=torch.long, device=roots.device)  # room for any depth
    paths[:, 0, 0] = roots
    for i in range(1, m + 1):  # parents come before their children
        paths[:, i] = paths[rows, tree.parents[:, i - 1]]
        paths[rows, i, tree.depths[:, i - 1]] = tree.tokens[:, i - 1]
    return paths[..., :length]
