"""Every response's emitted tokens, kept on the device and appended to without a host sync.

A decoding step emits up to K tokens per cache row; `append` keeps each live row's tokens up
to and including its first stop token and within its length cap, and says which rows have
just finished. Nothing here reads a tensor on the host: the engine reads the `live` flags
every few steps (to compact the batch and to stop), and `to_lists` once at the end.
"""
from __future__ import annotations

import torch


class ResponseBuffer:
    def __init__(self, caps: torch.Tensor, stop_ids: set[int], width: int, device) -> None:
        self.responses = caps.shape[0]
        # One row beyond the responses, and at least two stop ids (-1 is no token): a compiled
        # append would specialise on one response, on no or one stop id, and on a batch of every row.
        rows = self.responses + 1
        self.caps = torch.cat((caps, caps.new_zeros(1))).to(device)  # [rows] most tokens each response may hold
        self.stop_ids = torch.tensor(sorted(stop_ids) + [-1] * (2 - len(stop_ids)), dtype=torch.long, device=device)
        # One extra column: writes a row must not make land there and are never read.
        self.tokens = torch.zeros(rows, width + 1, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, width + 1, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=device)  # ended by a stop token

    @property
    def sink(self) -> int:
        return self.tokens.shape[1] - 1

    def append(self, row_ids: torch.Tensor, live: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
               counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Record a step's emissions (`tokens`, `logprobs` [B, K], the first `counts` [B] real) for
        cache rows holding responses `row_ids` [B]; only `live` [B] rows count. Returns the rows
        that finished with this step (a stop token or the cap), [B] bool, and the tokens each row
        kept (cut there), [B]."""
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        real = (offsets < counts[:, None]) & live[:, None]
        is_stop = torch.isin(tokens, self.stop_ids) & real
        # Through the first stop token, and no further than the cap.
        through_stop = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, counts)
        start = self.lengths[row_ids]
        room = self.caps[row_ids] - start
        kept = torch.minimum(through_stop, room) * live
        columns = torch.where(offsets < kept[:, None], start[:, None] + offsets, self.sink)
        rows = row_ids[:, None].expand_as(columns)
        self.tokens.index_put_((rows, columns), tokens)
        self.logprobs.index_put_((rows, columns), logprobs.float())
        stopped = (is_stop & (offsets < kept[:, None])).any(1)
        self.lengths[row_ids] = start + kept
        self.stopped[row_ids] |= stopped
        return live & (stopped | (start + kept >= self.caps[row_ids])), kept

    def to_lists(self) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Token ids, log-probs and finish reasons ("stop" or "length") of every response."""
        n = self.responses
        lengths = self.lengths[:n].tolist()
        tokens, logprobs, stopped = self.tokens[:n].tolist(), self.logprobs[:n].tolist(), self.stopped[:n].tolist()
        return ([row[:n] for row, n in zip(tokens, lengths)], [row[:n] for row, n in zip(logprobs, lengths)],
                ["stop" if s else "length" for s in stopped])
