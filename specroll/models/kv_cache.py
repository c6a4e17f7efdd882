"""Preallocated KV cache with per-row lengths.

Rows are responses. Every forward appends T new slots per row right after the row's cached
prefix (`lengths[b] .. lengths[b] + T`), whatever those T tokens are: a prompt, one decoded
token, or a draft tree. Which appended slots survive is decided afterwards by the caller:
`commit` keeps the first k of them (linear decoding), `commit_gather` moves an arbitrary
subset into place (the accepted path of a tree). Slots beyond `lengths` are never read.

Each layer has its own key and value tensors: a compiled step then writes and reads them in
place, where slices of one tensor for all layers made inductor copy the attended span per layer.
"""
from __future__ import annotations

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, [rows, heads, slots, head_dim] each


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,  # None: torch's default device
        live_rows: int | None = None,
    ) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for tensor in (*self.k, *self.v):
            # Heads and head size never change: a compiled step must not treat them as sizes that
            # happen to equal another (duck sizing), or it recompiles when they stop being equal.
            torch._dynamo.mark_static(tensor, 1)
            torch._dynamo.mark_static(tensor, 3)
        self.rows = batch_size  # rows allocated
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        # Rows 0..batch_size-1 are live; `batch_size` rows are allocated, `live_rows` start live
        # (fewer when prompts are prefilled once and then repeated for their n samples).
        self.batch_size = batch_size if live_rows is None else live_rows

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int, live_rows: int | None = None) -> "KVCache":
        cfg = model.config
        p = next(model.parameters())
        return cls(cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim, p.dtype, p.device, live_rows)

    def mark_static(self) -> None:
        """Tell torch.compile the tensors stay at one address (CUDA graphs write them in place,
        the lengths too where a compiled tree step keeps its accepted path)."""
        for tensor in (*self.k, *self.v, self.lengths):
            torch._dynamo.mark_static_address(tensor)

    # -- used by the attention layers during a forward ------------------------------------
    def append_slots(self, batch: int, num_new: int, span: int | None = None) -> torch.Tensor:
        """Slot index of every new token of the `batch` live rows, [B, T]. Without `span` it raises
        if a row would overflow (a host sync); with it the caller guarantees every row fits in `span`."""
        lengths = self.lengths[:batch]
        if span is None and int(lengths.max()) + num_new > self.max_len:
            raise ValueError(
                f"KV cache overflow: a row needs {int(lengths.max()) + num_new} slots, "
                f"the cache holds {self.max_len}"
            )
        return lengths[:, None] + torch.arange(num_new, device=lengths.device)

    def layer(self, layer: int) -> LayerKV:
        """Layer `layer`'s keys and values, which its attention writes and reads in place (`store`, `attended`)."""
        return self.k[layer], self.v[layer]

    def attention_mask(self, new_token_mask: torch.Tensor, span: int | None = None) -> torch.Tensor:
        """Which slots each new token may attend to, [B, 1, T, S].

        A new token sees its row's cached prefix plus the new tokens that `new_token_mask`
        ([B, T, T], True = visible) allows: causal for a sequence, ancestors for a tree.
        S is `span` when given (a fixed shape, built without reading lengths on the host),
        else the longest row's prefix plus T.
        """
        batch, num_new, _ = new_token_mask.shape
        num_slots = int(self.lengths[:batch].max()) + num_new if span is None else span
        slot = torch.arange(num_slots, device=new_token_mask.device)
        lengths = self.lengths[:batch, None]
        cached = (slot[None, :] < lengths)[:, None, :].expand(batch, num_new, num_slots)
        rel = slot[None, :] - lengths  # position of each slot among the new tokens
        in_new = (rel >= 0) & (rel < num_new)
        idx = rel.clamp(0, num_new - 1)[:, None, :].expand(batch, num_new, num_slots)
        new_visible = torch.gather(new_token_mask, 2, idx) & in_new[:, None, :]
        return (cached | new_visible)[:, None]

    # -- bookkeeping after a forward, by the engine ---------------------------------------
    def commit(self, counts: torch.Tensor) -> None:
        """Keep the first `counts[b]` appended slots of each row (linear decoding, prefill)."""
        self.lengths[: self.batch_size] += counts

    def commit_gather(self, node_index: torch.Tensor, counts: torch.Tensor) -> None:
        """Keep appended slots `node_index[b, :counts[b]]` (in that order) as the row's next tokens.

        `node_index` is relative to the row's pre-forward length (the tree node order of the
        last forward). Used to keep the accepted path of a draft tree.
        """
        batch, width = node_index.shape
        rows = torch.arange(batch, device=node_index.device)[:, None].expand(batch, width)
        base = self.lengths[:batch, None]
        src, dst = base + node_index, base + torch.arange(width, device=node_index.device)
        # Entries past a row's count are moved too: they land beyond its new length, where nothing is read.
        # Indexed whole-tensor, as `store` writes: compiled, that updates the cache in place, where an
        # index_copy_ into a flattened view of it made inductor copy each layer's cache out and back.
        for cache in (*self.k, *self.v):
            cache[rows, :, dst] = cache[rows, :, src]  # every source is read before any slot is written
        self.lengths[:batch] += counts

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (in that order) as rows 0..len(rows)-1; the rest are dropped.

        Only the used prefix of moved rows is copied, so dropping a finished row costs
        little and the row costs nothing in later forwards.
        """
        rows = rows.to(self.lengths.device)
        n = rows.numel()
        moved = rows != torch.arange(n, device=rows.device)
        if bool(moved.any()):
            src = rows[moved]
            dst = torch.arange(n, device=rows.device)[moved]
            used = int(self.lengths[src].max())
            for cache in (*self.k, *self.v):
                cache[dst, :, :used] = cache[src, :, :used]
            self.lengths[dst] = self.lengths[src]
        self.batch_size = n

    def repeat_rows(self, repeats: int) -> None:
        """Row b becomes rows b*repeats .. b*repeats+repeats-1 (a prompt's n samples share its prefill)."""
        n = self.batch_size
        if n * repeats > self.rows:
            raise ValueError(f"cannot repeat {n} rows {repeats} times: cache has {self.rows} rows")
        used = int(self.lengths[:n].max())
        # Walk backwards so no source row is overwritten before it is copied.
        for b in range(n - 1, -1, -1):
            dst = slice(b * repeats, (b + 1) * repeats)
            for cache in (*self.k, *self.v):
                cache[dst, :, :used] = cache[b : b + 1, :, :used]
            self.lengths[dst] = self.lengths[b].clone()  # a view of the same tensor: CUDA refuses the overlap
        self.batch_size = n * repeats


def store(layer_kv: LayerKV, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store a layer's new keys / values ([B, H, T, D]) at `slots` ([B, T]) of its `layer_kv`."""
    keys, values = layer_kv
    rows = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)
    keys[rows, :, slots] = k.transpose(1, 2)
    values[rows, :, slots] = v.transpose(1, 2)


def attended(layer_kv: LayerKV, batch: int, num_slots: int) -> LayerKV:
    """Keys and values of the first `num_slots` slots of the `batch` live rows, [B, H, S, D]."""
    # narrow, not slicing: a compiled step then needs num_slots <= slots, not a guard on whether they are equal
    keys, values = layer_kv
    return keys.narrow(0, 0, batch).narrow(2, 0, num_slots), values.narrow(0, 0, batch).narrow(2, 0, num_slots)
