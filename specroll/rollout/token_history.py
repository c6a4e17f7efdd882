"""Token ids each row holds so far (prompt + emitted), as one padded tensor on the model's device.

The KV cache keeps keys and values, not ids; drafters that read a row's own context (context
lookup, `specroll.spec.lookup`) need the ids, without a per-step copy from Python lists.
"""
from __future__ import annotations

import torch


class TokenHistory:
    def __init__(self, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        self.tokens = tokens  # [B, capacity] ids; entries at or after a row's length are padding
        self.lengths = lengths  # [B] ids held per row

    @classmethod
    def from_prompts(cls, prompts: list[list[int]], capacity: int, device) -> "TokenHistory":
        tokens = torch.zeros(len(prompts), capacity, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p, device=device)
        return cls(tokens, torch.tensor([len(p) for p in prompts], device=device))

    def repeat_rows(self, n: int) -> None:
        """Each row n times in a row (one per response of a prompt)."""
        self.tokens = self.tokens.repeat_interleave(n, dim=0)
        self.lengths = self.lengths.repeat_interleave(n)

    def append(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Add the first counts[r] of tokens[r] [B, K] to each row, as far as capacity allows
        (a row is finished by then: the engine sizes capacity for its longest response)."""
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        columns = self.lengths[:, None] + offsets
        write = (offsets < counts[:, None]) & (columns < self.tokens.shape[1])
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(tokens)
        self.tokens[rows[write], columns[write]] = tokens[write]
        self.lengths = self.lengths + write.sum(1)

    def keep(self, rows: torch.Tensor) -> None:
        self.tokens = self.tokens[rows]
        self.lengths = self.lengths[rows]
