"""Would-be trees: what a tree would have carried on the steps that decoded plain.

With coupled draws the sample at a tree's node of depth d is the token plain sampling emits d
steps later (verify.py), so walking a tree drafted before a plain step along the tokens emitted
after it reaches exactly the node that sample-and-match would have reached: its accepted drafts
plus the bonus token are the tokens that tree would have emitted in one verify pass. Nothing
sampled changes; only drafts are scored. A row holds at most one tree at a time, scored as its
tokens arrive (plain steps or trees alike) and done at the first emitted token that matches no
drafted child.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..drafting.tree import Candidates, DraftTree


class WouldBeDone(NamedTuple):
    """The trees that a call of `WouldBeTrees.advance` finished, one row each (as a verdict's
    calibration signals, `step.calibrated`)."""

    done: torch.Tensor  # [B] whether the row's tree finished
    accepted_at_depth: torch.Tensor  # [B, H] whether depth d+1 was accepted
    reached_node_prob: torch.Tensor  # [B, H] head probability mass drafted below the node reached at depth d


def node_ranks(cands: Candidates, tree: DraftTree) -> torch.Tensor:
    """[B, M] each tree node's place in its row's candidate ranking: a node is in the best tree of
    n nodes iff its rank is below n - 1 (best-k trees nest, drafting/tree.py)."""
    ranked = cands.ranked()
    rank_of = torch.empty_like(ranked).scatter_(1, ranked, torch.arange(ranked.shape[1], device=ranked.device).expand_as(ranked))
    return torch.gather(rank_of, 1, tree.candidates)


def matched_child(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, current: torch.Tensor,
                  emitted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(moved [B], the child's node index [B]): whether the token each row emitted at its current
    node (combined index, 0 = root) is a drafted child of it, and which one."""
    match = (parents == current[:, None]) & (tokens == emitted[:, None]) & valid
    return match.any(dim=1), match.int().argmax(dim=1) + 1  # children carry distinct tokens


class WouldBeTrees:
    """Each row's would-be tree of `nodes` nodes (root included) in a generate call, walked along
    its emitted tokens on the device, and the tokens per pass of every tree size 1..`nodes` that
    the finished ones would have emitted (summed until `pop_sums`). Rows are kept by output row id,
    so the engine may compact its batch in between."""

    def __init__(self, nodes: int, max_depth: int, device) -> None:
        self.nodes, self.max_depth, self.device = nodes, max_depth, device
        # Tokens per pass summed over finished trees by tree size, and how many finished: since the
        # last `pop_sums` (a generate call's stats) and since the last `pop_fresh` (the cost model's).
        self.sums, self.passes = torch.zeros(nodes, device=device), torch.zeros((), device=device)
        self.fresh_sums, self.fresh_passes = torch.zeros(nodes, device=device), torch.zeros((), device=device)
        self.reset()

    def reset(self) -> None:
        """Forget every row's tree (a new generate call, other rows), keeping the sums."""
        self.active: torch.Tensor | None = None  # [R] allocated at a call's first step, R its rows
        # Steps until every live row's tree is surely done (a live row emits a token or more per
        # step), counted on the host: steps after that walk nothing and skip the walk.
        self.steps_to_done = 0

    def allocate(self, rows: int) -> None:
        """Room for output row ids below `rows`."""
        drafts, depth, dev = self.nodes - 1, self.max_depth, self.device
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.tokens, self.parents, self.ranks, self.depths = torch.zeros(4, rows, drafts, dtype=torch.long, device=dev)
        self.valid = torch.zeros(rows, drafts, dtype=torch.bool, device=dev)
        self.child_mass = torch.zeros(rows, drafts + 1, device=dev)
        self.current = torch.zeros(rows, dtype=torch.long, device=dev)
        self.accepted = torch.zeros(rows, depth, dtype=torch.bool, device=dev)
        self.mass = torch.zeros(rows, depth, device=dev)
        self.emitted_by_size = torch.ones(rows, self.nodes, device=dev)

    def idle(self, row_ids: torch.Tensor) -> torch.Tensor:
        """[B] rows holding no tree now."""
        if self.active is None:
            # One host read a call: compaction only drops rows, so no later row id is larger.
            self.allocate(int(row_ids.max()) + 1)
        return ~self.active[row_ids]

    def start(self, row_ids: torch.Tensor, tree: DraftTree, ranks: torch.Tensor, rows: torch.Tensor) -> None:
        """Give `tree` (of nodes - 1 drafts, `ranks` from `node_ranks`) to the rows where `rows` [B]
        holds and that hold none."""
        take = rows & self.idle(row_ids)
        short = self.nodes - 1 - tree.num_drafts  # fewer candidates than drafts: padded with invalid nodes
        tree = DraftTree(*(torch.nn.functional.pad(t, (0, short)) for t in
                           (tree.tokens, tree.parents, tree.depths, tree.valid, tree.head_probs)))
        ranks = torch.nn.functional.pad(ranks, (0, short), value=self.nodes)
        child_mass = torch.zeros(tree.tokens.shape[0], tree.num_drafts + 1, device=self.device)
        child_mass.scatter_add_(1, tree.parents, tree.head_probs.float() * tree.valid)

        def put(held: torch.Tensor, new) -> None:  # rows that take a tree get `new`, without a host read
            mask = take.view(-1, *[1] * (held.dim() - 1))
            held[row_ids] = torch.where(mask, new, held[row_ids])

        put(self.tokens, tree.tokens)
        put(self.parents, tree.parents)
        put(self.valid, tree.valid)
        put(self.ranks, ranks)
        put(self.depths, tree.depths)
        put(self.child_mass, child_mass)
        put(self.current, torch.zeros_like(self.current[row_ids]))
        put(self.accepted, torch.zeros_like(self.accepted[row_ids]))
        put(self.mass, torch.zeros_like(self.mass[row_ids]))
        put(self.emitted_by_size, torch.ones_like(self.emitted_by_size[row_ids]))  # the bonus token, whatever the tree
        put(self.active, torch.ones_like(take))
        self.steps_to_done = self.max_depth + 1

    def advance(self, row_ids: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> WouldBeDone | None:
        """Walk the rows' trees along this step's emitted `tokens` [B, K] (the first `counts` [B]
        real); the trees finished are summed by size and returned for calibration (None: no live
        row held a tree)."""
        if self.steps_to_done == 0:
            return None
        self.steps_to_done -= 1
        active, current = self.active[row_ids], self.current[row_ids]
        accepted, mass, by_size = self.accepted[row_ids], self.mass[row_ids], self.emitted_by_size[row_ids]
        tree = (self.tokens[row_ids], self.parents[row_ids], self.valid[row_ids])
        ranks, depths, child_mass = self.ranks[row_ids], self.depths[row_ids], self.child_mass[row_ids]
        done = torch.zeros_like(active)
        sizes = torch.arange(self.nodes, device=self.device)
        levels = torch.arange(self.max_depth, device=self.device)
        for k in range(tokens.shape[1]):
            walking = active & ~done & (k < counts)
            moved, child = matched_child(*tree, current, tokens[:, k])
            moved &= walking
            depth = torch.gather(torch.cat((torch.zeros_like(depths[:, :1]), depths), 1), 1, current[:, None])[:, 0]
            at = (levels[None] == depth[:, None]) & walking[:, None]
            mass = torch.where(at, torch.gather(child_mass, 1, current[:, None]), mass)
            accepted = accepted | (at & moved[:, None])
            rank = torch.gather(ranks, 1, (child - 1)[:, None])
            by_size = by_size + (moved[:, None] & (sizes[None] > rank)).float()  # sizes holding the child count it
            current = torch.where(moved, child, current)
            done |= walking & ~moved
        self.current[row_ids], self.accepted[row_ids], self.mass[row_ids] = current, accepted, mass
        self.emitted_by_size[row_ids] = by_size
        self.active[row_ids] = active & ~done
        finished = (by_size * done[:, None]).sum(0)
        self.sums, self.fresh_sums = self.sums + finished, self.fresh_sums + finished
        self.passes, self.fresh_passes = self.passes + done.sum(), self.fresh_passes + done.sum()
        return WouldBeDone(done, accepted, mass)

    def pop_sums(self) -> tuple[list[float], int]:
        """(tokens per pass by tree size 1..nodes summed over the trees finished since the last pop,
        how many finished), in one host read, and start them afresh. At a generate call's end,
        trees cut short by their row's end count what they matched: leaving them out would drop
        only trees that were still being accepted."""
        if self.active is not None:
            self.sums = self.sums + (self.emitted_by_size * self.active[:, None]).sum(0)
            self.passes = self.passes + self.active.sum()
            self.active.zero_()
        read = torch.cat((self.sums, self.passes[None])).tolist()
        self.sums, self.passes = torch.zeros_like(self.sums), torch.zeros_like(self.passes)
        return read[:-1], int(read[-1])

    def pop_fresh(self) -> torch.Tensor | None:
        """Mean tokens per pass by tree size 1..nodes of the trees finished since the last call, on
        the host (one read); None if none finished."""
        read = torch.cat((self.fresh_sums, self.fresh_passes[None])).cpu()
        self.fresh_sums, self.fresh_passes = torch.zeros_like(self.fresh_sums), torch.zeros_like(self.fresh_passes)
        return read[:-1] / read[-1] if read[-1] > 0 else None
