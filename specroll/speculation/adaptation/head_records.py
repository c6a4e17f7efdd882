"""What a rollout tells the slow path: per-head telemetry of every verify pass, and a bounded,
uniform sample of matured records (docs/algorithm.md, section 6).

A matured record (speculation/adaptation/maturation.py) becomes a `MaturedRecords` row: what head j read (h_t
and the tokens on its path), what it proposed (its sketch), what the policy said there at
temperature 1 (top-K + tail, the distribution heads are trained on) and the token sampled
there. Telemetry counts every record (TV and cross-entropy per head and depth bucket) and
every verified draft (acceptance); records are kept by reservoir sampling, so a generate call
sends at most `max_records` of them, each record equally likely to be among them.

`record_nodes` says which records are kept for head updates: "path", those on the accepted
path (the paper's); or "tree", every verified node a head drafted from. On the path alone a
head of depth j only sees positions where the heads before it were right; off the path a
record has no realised token (-1: no NLL term). Telemetry always comes from the path.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..drafting.heads import draft_policy_top
from ..drafting.tree import Proposal
from .drift_detector import HeadTelemetry, depth_bucket, merge_telemetry
from .maturation import MaturedProposals, node_paths, tree_proposals
from .replay import MaturedRecords, cat_records

TARGET_TOP_K = 32  # target tokens kept per record
RECORD_NODES = ("path", "tree")


def log_tail(top_logp: torch.Tensor) -> torch.Tensor:
    """[N] log of the mass outside the top entries [N, K] (floored: a full top has no tail)."""
    return torch.log1p(-top_logp.exp().sum(dim=-1).clamp(max=1 - 1e-6))


def sketch_tv_and_nll(target_logp: torch.Tensor, target_ids: torch.Tensor, head_logp: torch.Tensor,
                      head_ids: torch.Tensor, token: torch.Tensor, head_tail: torch.Tensor):
    """TV between target and head over the union of both tops (the rest as one bucket) and the
    head's cross-entropy of the realised token (a token outside its sketch gets the tail's mass)."""
    in_head = target_ids[:, :, None] == head_ids[:, None, :]  # [N, K, m]
    q_on_target = (in_head * head_logp.exp()[:, None, :]).sum(-1)
    head_only = ~in_head.any(1)  # [N, m] sketch tokens outside the target's top
    p_top, q_only = target_logp.exp(), head_logp.exp() * head_only
    diff = (p_top - q_on_target).abs().sum(1) + q_only.sum(1)
    rest = (1 - p_top.sum(1)) - (1 - q_on_target.sum(1) - q_only.sum(1))
    tv = 0.5 * (diff + rest.abs())
    hit = head_ids == token[:, None]
    nll = torch.where(hit.any(1), -(head_logp * hit).sum(1), -head_tail)
    return tv, nll


def target_top(logits: torch.Tensor, matured: MaturedProposals,
               draft_vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's top-K log-probs and token ids [R, K] at each record's node (logits [B, 1+M, V]),
    restricted to the heads' draft vocabulary: what heads with one are trained to draft."""
    logp, ids, _ = draft_policy_top(logits, matured.row, matured.node, draft_vocab, TARGET_TOP_K)
    return logp, ids


class HeadRecords(NamedTuple):
    """What one rollout actor's generate calls tell the slow path."""

    telemetry: HeadTelemetry  # every verify pass's, merged
    matured: MaturedRecords | None  # the reservoir sample of matured records; None: none matured


class RecordCollector:
    """Gathers a generate call's slow-path telemetry and record sample; `pop` hands them over."""

    def __init__(self, num_heads: int, depth_buckets: tuple[int, ...], max_records: int, seed: int = 0,
                 record_nodes: str = "path") -> None:
        if record_nodes not in RECORD_NODES:
            raise ValueError(f"record_nodes must be one of {RECORD_NODES}, got {record_nodes!r}")
        self.num_heads, self.edges, self.max_records = num_heads, depth_buckets, max_records
        self.record_nodes = record_nodes
        self.generator = torch.Generator().manual_seed(seed)
        self.reset()

    def follow_heads(self, num_heads: int) -> None:
        """Collect for heads of `num_heads` from now on (telemetry and paths are per head): heads of
        another count drop what was gathered for the old ones, which has their shape."""
        if num_heads != self.num_heads:
            self.num_heads = num_heads
            self.reset()

    def reset(self) -> None:
        self.telemetry: list[HeadTelemetry] = []
        self.kept: MaturedRecords | None = None
        self.keys = torch.zeros(0)  # reservoir keys of the kept records: the smallest ones stay

    def add_pass(self, matured: MaturedProposals, logits: torch.Tensor, verdict, tree, hidden: torch.Tensor,
                 roots: torch.Tensor, generated: torch.Tensor, responses: torch.Tensor, head_version: int,
                 gates: torch.Tensor | None = None, proposals: list[Proposal] | None = None,
                 draft_vocab: torch.Tensor | None = None) -> None:
        """One verify pass: logits [B, 1+M, V] of the policy, hidden [B, D] h_t, roots [B],
        generated [B] tokens each response had before this pass, responses [B] each row's index in
        the generate call's output; gates [R] Reflex's (None: 0);
        proposals: the heads' sketches of the pass (needed when `record_nodes` is "tree");
        draft_vocab: the token ids the heads draft among (None: all)."""
        buckets = len(self.edges) + 1
        bucket_of_row = depth_bucket(generated, self.edges)
        self.telemetry.append(self.trials(verdict, tree, bucket_of_row))
        if not len(matured.row):
            return
        r, j = matured.row, matured.depth
        target_logp, target_ids = target_top(logits, matured, draft_vocab)
        token = verdict.tokens[r, j]
        head_tail = log_tail(matured.head_logp)
        tv, nll = sketch_tv_and_nll(target_logp, target_ids, matured.head_logp, matured.head_ids, token, head_tail)
        self.telemetry.append(HeadTelemetry.from_records(self.num_heads, buckets, j, bucket_of_row[r], tv, nll,
                                                         torch.zeros_like(tv) if gates is None else gates))
        if self.record_nodes == "tree":
            if proposals is None:
                raise ValueError("record_nodes='tree' needs the pass's proposals")
            matured, on_path = tree_proposals(proposals, tree, verdict)
            r, j = matured.row, matured.depth
            target_logp, target_ids = target_top(logits, matured, draft_vocab)
            token = torch.where(on_path, verdict.tokens[r, j.clamp(max=verdict.tokens.shape[1] - 1)], -1)
            head_tail = log_tail(matured.head_logp)
            path = node_paths(tree, roots, self.num_heads)[r, matured.node]
        else:
            path = torch.cat((roots[:, None], verdict.tokens[:, : self.num_heads - 1]), dim=1)
            path = torch.nn.functional.pad(path, (0, self.num_heads - path.shape[1]))[r]  # [R, H]
        records = MaturedRecords(
            head=j.cpu(), hidden=hidden[r].half().cpu(), path_tokens=path.cpu(), token=token.cpu(),
            target_logp=target_logp.cpu(), target_ids=target_ids.cpu(), target_tail=log_tail(target_logp).cpu(),
            proposal_logp=matured.head_logp.float().cpu(), proposal_ids=matured.head_ids.cpu(),
            proposal_tail=head_tail.cpu(), policy_version=torch.full_like(j, -1).cpu(),
            head_version=torch.full_like(j, head_version).cpu(), bucket=bucket_of_row[r].cpu(),
            response=responses[r].cpu())
        self.keep(records)

    def trials(self, verdict, tree, bucket_of_row: torch.Tensor) -> HeadTelemetry:
        """Every verified draft: head d's drafts were tried where the node at depth d was reached with children."""
        acc = verdict.accepted_at_depth  # [B, D]
        reached = torch.cat((torch.ones_like(acc[:, :1]), acc[:, :-1]), dim=1)
        nodes = verdict.path[:, : acc.shape[1]]
        has_children = ((tree.parents[:, None, :] == nodes[..., None]) & tree.valid[:, None, :]).any(-1)
        tried = reached & has_children
        b, d = tried.nonzero(as_tuple=True)
        return HeadTelemetry.from_trials(self.num_heads, len(self.edges) + 1, d, bucket_of_row[b], acc[b, d])

    def keep(self, records: MaturedRecords) -> None:
        """Reservoir sampling: every record gets a uniform key and the `max_records` smallest stay."""
        keys = torch.rand(len(records), generator=self.generator)
        merged = records if self.kept is None else cat_records([self.kept, records])
        self.keys = torch.cat((self.keys, keys))
        if len(merged) > self.max_records:
            stay = self.keys.topk(self.max_records, largest=False).indices.sort().values
            merged, self.keys = merged.select(stay), self.keys[stay]
        self.kept = merged

    def pop(self) -> HeadRecords:
        """The call's telemetry (all passes merged) and record sample; starts afresh."""
        buckets = len(self.edges) + 1
        telemetry = merge_telemetry(self.telemetry) if self.telemetry else HeadTelemetry.zeros(self.num_heads, buckets)
        kept = self.kept
        self.reset()
        return HeadRecords(telemetry, kept)
