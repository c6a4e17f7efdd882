"""Token ids each row holds so far (prompt + emitted), as one padded tensor on the model's device.

The KV cache keeps keys and values, not ids; drafters that read a row's own context (context
lookup, `specroll.speculation.drafting.lookup`) need the ids, without a per-step copy from Python lists.
"""
from __future__ import annotations

import torch


class TokenHistory:
    def __init__(self, buffer: torch.Tensor, lengths: torch.Tensor) -> None:
        # [B, capacity + 1]: the last column takes writes that must not land, so appending
        # needs no data-dependent indexing (no host sync).
        self.buffer = buffer
        self.lengths = lengths  # [B] ids held per row

    @property
    def tokens(self) -> torch.Tensor:
        """[B, capacity] ids; entries at or after a row's length are padding."""
        return self.buffer[:, :-1]

    @classmethod
    def from_prompts(cls, prompts: list[list[int]], capacity: int, device) -> "TokenHistory":
        buffer = torch.zeros(len(prompts), capacity + 1, dtype=torch.long)
        for i, p in enumerate(prompts):
            buffer[i, : len(p)] = torch.tensor(p)
        return cls(buffer.to(device), torch.tensor([len(p) for p in prompts], device=device))

    def repeat_rows(self, n: int) -> None:
        """Each row n times in a row (one per response of a prompt)."""
        self.buffer = self.buffer.repeat_interleave(n, dim=0)
        self.lengths = self.lengths.repeat_interleave(n)

    def append(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Add the first counts[r] of tokens[r] [B, K] to each row, as far as capacity allows
        (a row is finished by then: the engine sizes capacity for its longest response)."""
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        columns = self.lengths[:, None] + offsets
        sink = self.buffer.shape[1] - 1
        write = (offsets < counts[:, None]) & (columns < sink)
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(tokens)
        self.buffer.index_put_((rows, torch.where(write, columns, sink)), tokens)
        self.lengths = self.lengths + write.sum(1)

    def keep(self, rows: torch.Tensor) -> None:
        self.buffer = self.buffer[rows]
        self.lengths = self.lengths[rows]
