"""What the drafter learns from: responses with the policy's features at their positions.

A response y_1..y_n to a prompt of length P comes with the features h_{P-1}..h_{P+n-2} (the
final hidden state at the position that predicted each y_j). Drafter entry j reads (h_{P-1+j},
y_{j+1}) and learns to predict h_{P+j}, for j = 0..n-2. During a rollout the verify passes
compute exactly these features (`FeatureLog`); pretraining gets them from one teacher-forced
pass over sampled sequences (`teacher_forced_sequences`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftSequences:
    features: torch.Tensor  # [R, T, D] h at positions start .. start + T - 1 (padded past each length)
    tokens: torch.Tensor  # [R, T] response tokens y_1 .. y_T (padded)
    lengths: torch.Tensor  # [R] response tokens of each row
    start_positions: torch.Tensor  # [R] position of the first feature (prompt length - 1)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_entries(self) -> int:
        """Training entries: every response token but the last has a next feature to predict."""
        return int((self.lengths - 1).clamp(min=0).sum())

    def select(self, rows: torch.Tensor) -> "DraftSequences":
        longest = int(self.lengths[rows].max())
        return DraftSequences(self.features[rows, :longest], self.tokens[rows, :longest], self.lengths[rows],
                              self.start_positions[rows])

    def to(self, device=None, dtype=None) -> "DraftSequences":
        return DraftSequences(self.features.to(device=device, dtype=dtype), self.tokens.to(device), self.lengths.to(device),
                              self.start_positions.to(device))

    @classmethod
    def cat(cls, parts: list["DraftSequences"]) -> "DraftSequences":
        longest = max(p.tokens.shape[1] for p in parts)
        pad = lambda x: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, longest - x.shape[1]))  # noqa: E731
        return cls(torch.cat([pad(p.features) for p in parts]), torch.cat([pad(p.tokens) for p in parts]),
                   torch.cat([p.lengths for p in parts]), torch.cat([p.start_positions for p in parts]))


class FeatureLog:
    """The features a generate call's verify passes computed, per response (slot = row at the first step)."""

    def __init__(self, row_ids: torch.Tensor, start_positions: torch.Tensor, length: int, like: torch.Tensor) -> None:
        self.row_ids = row_ids.clone()  # output index of each slot
        self.start_positions = start_positions.clone()
        self.features = like.new_zeros(len(row_ids), length, like.shape[-1])

    def slots(self) -> torch.Tensor:
        return torch.arange(len(self.row_ids), device=self.row_ids.device)

    def write(self, slots: torch.Tensor, first_index: torch.Tensor, features: torch.Tensor, counts: torch.Tensor) -> None:
        """Row b's first `counts[b]` of `features` [B, W, D] go to its slot at indices first_index[b] onwards."""
        j = torch.arange(features.shape[1], device=features.device)
        index = first_index[:, None] + j
        ok = (j < counts[:, None]) & (index < self.features.shape[1])
        self.features[slots[:, None].expand_as(index)[ok], index[ok]] = features[ok]

    def sequences(self, token_ids: list[list[int]]) -> DraftSequences | None:
        """The logged responses of at least two tokens (`token_ids`: the generate call's output)."""
        rows = [(s, token_ids[r][: self.features.shape[1]]) for s, r in enumerate(self.row_ids.tolist())]
        rows = [(s, t) for s, t in rows if len(t) >= 2]
        if not rows:
            return None
        slots = torch.tensor([s for s, _ in rows], device=self.features.device)
        lengths = torch.tensor([len(t) for _, t in rows], device=self.features.device)
        tokens = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long, device=self.features.device)
        for i, (_, t) in enumerate(rows):
            tokens[i, : len(t)] = torch.tensor(t)
        return DraftSequences(self.features[slots, : tokens.shape[1]].clone(), tokens, lengths, self.start_positions[slots])


@torch.no_grad()
def teacher_forced_sequences(model, prompts: list[list[int]], responses: list[list[int]],
                             batch_tokens: int = 8192) -> DraftSequences:
    """Features of `responses` (each after its prompt) from teacher-forced policy passes, as a rollout logs them."""
    device = next(model.parameters()).device
    keep = [i for i, r in enumerate(responses) if len(r) >= 2]
    if not keep:
        raise ValueError("no response has two tokens: nothing for the drafter to learn")
    order = sorted(keep, key=lambda i: len(prompts[i]) + len(responses[i]))
    parts, batch = [], []

    def flush() -> None:
        ids = [prompts[i] + responses[i] for i in batch]
        width = max(len(x) for x in ids)
        padded = torch.zeros(len(ids), width, dtype=torch.long, device=device)
        for row, x in enumerate(ids):
            padded[row, : len(x)] = torch.tensor(x, device=device)
        hidden = model(padded, logits_at=torch.zeros(len(ids), 1, dtype=torch.long, device=device)).hidden
        longest = max(len(responses[i]) for i in batch)
        start = torch.tensor([len(prompts[i]) - 1 for i in batch], device=device)
        index = (start[:, None] + torch.arange(longest, device=device)).clamp(max=width - 1)
        features = torch.gather(hidden, 1, index[..., None].expand(-1, -1, hidden.shape[-1]))
        tokens = torch.zeros(len(batch), longest, dtype=torch.long, device=device)
        for row, i in enumerate(batch):
            tokens[row, : len(responses[i])] = torch.tensor(responses[i], device=device)
        lengths = torch.tensor([len(responses[i]) for i in batch], device=device)
        parts.append(DraftSequences(features, tokens, lengths, start))
        batch.clear()

    for i in order:
        if batch and (len(batch) + 1) * (len(prompts[i]) + len(responses[i])) > batch_tokens:
            flush()
        batch.append(i)
    flush()
    return DraftSequences.cat(parts)
