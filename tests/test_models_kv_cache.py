"""KV cache bookkeeping: every cached forward must give the logits of a full recompute."""
from __future__ import annotations

import pytest
import torch

from specroll.models import KVCache, build_tiny_model

ATOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen3"])  # qwen3: keys normalised before they are cached
def model(request):
    # A wide initialisation makes attention peaky, so a wrong cache slot changes the logits.
    return build_tiny_model(request.param, seed=3, init_std=0.2).eval()


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 64, (n,), generator=torch.Generator(torch.get_default_device()).manual_seed(seed)).tolist()


@torch.no_grad()
def recompute(model, seq: list[int]) -> torch.Tensor:
    """Logits after the last token of `seq`, without a cache."""
    return model(torch.tensor([seq])).logits[0, -1]


@torch.no_grad()
def append(model, cache: KVCache, chunks: list[list[int]], **kwargs) -> torch.Tensor:
    """Append one chunk per live row (right-padded to the longest); logits [B, T, V]."""
    width = max(len(c) for c in chunks)
    ids = torch.tensor([c + [0] * (width - len(c)) for c in chunks])
    return model(ids, cache=cache, **kwargs).logits


def new_cache(model, batch: int, max_len: int = 64, live_rows: int | None = None) -> KVCache:
    return KVCache.for_model(model, batch, max_len, live_rows=live_rows)


def test_attention_mask_hand_worked():
    cache = KVCache(num_layers=1, batch_size=2, max_len=8, num_kv_heads=1, head_dim=2)
    cache.lengths[:] = torch.tensor([1, 2])
    causal = torch.ones(2, 2, dtype=torch.bool).tril().expand(2, 2, 2)
    expected = torch.tensor(
        [
            [[1, 1, 0, 0], [1, 1, 1, 0]],  # one cached slot, new tokens in slots 1 and 2
            [[1, 1, 1, 0], [1, 1, 1, 1]],  # two cached slots, new tokens in slots 2 and 3
        ],
        dtype=torch.bool,
    )[:, None]
    assert torch.equal(cache.attention_mask(causal), expected)


def test_chunked_appends_with_per_row_lengths_and_partial_commits(model):
    seqs = [random_tokens(5, 0), random_tokens(9, 1)]
    cache = new_cache(model, 2)
    append(model, cache, seqs)
    cache.commit(torch.tensor([5, 9]))
    # Each step appends a chunk per row and keeps only its first `keep[b]` tokens.
    for step, (sizes, keep) in enumerate([((3, 3), (3, 1)), ((2, 4), (2, 4)), ((1, 1), (1, 1))]):
        chunks = [random_tokens(n, 10 + 2 * step + b) for b, n in enumerate(sizes)]
        logits = append(model, cache, chunks)
        for b in range(2):
            for j in range(sizes[b]):
                torch.testing.assert_close(logits[b, j], recompute(model, seqs[b] + chunks[b][: j + 1]), rtol=0, atol=ATOL)
        cache.commit(torch.tensor(keep))
        seqs = [seqs[b] + chunks[b][: keep[b]] for b in range(2)]
        assert cache.lengths[:2].tolist() == [len(s) for s in seqs]
    logits = append(model, cache, [[7], [8]])
    for b, nxt in enumerate([7, 8]):
        torch.testing.assert_close(logits[b, 0], recompute(model, seqs[b] + [nxt]), rtol=0, atol=ATOL)


def test_commit_gather_keeps_a_tree_path_in_order(model):
    # Tree of 4 nodes: 0 follows the prefix, 1 and 2 are children of 0, 3 is a child of 2.
    parents = [-1, 0, 0, 2]
    ancestors = []
    for node, parent in enumerate(parents):
        ancestors.append((ancestors[parent] if parent >= 0 else []) + [node])
    tree_mask = torch.zeros(4, 4, dtype=torch.bool)
    for node, path in enumerate(ancestors):
        tree_mask[node, path] = True
    depth = torch.tensor([len(p) - 1 for p in ancestors])

    prefixes = [random_tokens(4, 20), random_tokens(7, 21)]
    nodes = [random_tokens(4, 22), random_tokens(4, 23)]
    cache = new_cache(model, 2)
    append(model, cache, prefixes)
    cache.commit(torch.tensor([4, 7]))
    positions = cache.lengths[:2, None] + depth
    logits = append(model, cache, nodes, position_ids=positions, new_token_mask=tree_mask.expand(2, 4, 4))
    for b in range(2):
        for node, path in enumerate(ancestors):
            path_tokens = [nodes[b][i] for i in path]
            torch.testing.assert_close(logits[b, node], recompute(model, prefixes[b] + path_tokens), rtol=0, atol=ATOL)

    # Row 0 accepts the path 0 -> 2 -> 3, row 1 the path 0 -> 1 (padding after its count).
    kept = torch.tensor([[0, 2, 3], [0, 1, 0]])
    counts = torch.tensor([3, 2])
    cache.commit_gather(kept, counts)
    seqs = [prefixes[b] + [nodes[b][i] for i in kept[b, : counts[b]].tolist()] for b in range(2)]
    assert cache.lengths[:2].tolist() == [len(s) for s in seqs]
    logits = append(model, cache, [[5, 6], [9, 10]])
    for b, nxt in enumerate([[5, 6], [9, 10]]):
        for j in range(2):
            torch.testing.assert_close(logits[b, j], recompute(model, seqs[b] + nxt[: j + 1]), rtol=0, atol=ATOL)


@pytest.mark.parametrize("compiled", [False, True])
def test_commit_gather_reads_every_source_before_it_writes(compiled):
    # Sources that later destinations overwrite: row 1 moves slot 5 to 4 and slot 4 to 5, row 2 keeps
    # slot 1's old contents (read before slot 1 is written).
    cache = KVCache(2, 3, 12, 2, 4)
    generator = torch.Generator().manual_seed(0)
    for tensor in (*cache.k, *cache.v):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    cache.lengths[:3] = torch.tensor([3, 4, 0])
    before = [tensor.clone() for tensor in (*cache.k, *cache.v)]
    kept = torch.tensor([[0, 2, 3], [1, 0, 2], [2, 0, 1]])
    counts = torch.tensor([3, 2, 3])
    commit = torch.compile(KVCache.commit_gather, fullgraph=True) if compiled else KVCache.commit_gather
    commit(cache, kept, counts)
    assert cache.lengths[:3].tolist() == [6, 6, 3]
    for old, new in zip(before, (*cache.k, *cache.v)):
        for row, base in enumerate([3, 4, 0]):
            for j in range(3):
                assert torch.equal(new[row, :, base + j], old[row, :, base + kept[row, j]])


def test_keep_rows_drops_and_reorders(model):
    seqs = [random_tokens(3, 30), random_tokens(6, 31), random_tokens(4, 32)]
    cache = new_cache(model, 3)
    append(model, cache, seqs)
    cache.commit(torch.tensor([3, 6, 4]))

    cache.keep_rows(torch.tensor([2, 0]))
    seqs = [seqs[2], seqs[0]]
    assert cache.batch_size == 2 and cache.lengths[:2].tolist() == [4, 3]
    logits = append(model, cache, [[11], [12]])
    cache.commit(torch.tensor([1, 1]))
    seqs = [seqs[0] + [11], seqs[1] + [12]]
    for b in range(2):
        torch.testing.assert_close(logits[b, 0], recompute(model, seqs[b]), rtol=0, atol=ATOL)

    cache.keep_rows(torch.tensor([1, 0]))  # a swap: each row is the other's source
    seqs = [seqs[1], seqs[0]]
    logits = append(model, cache, [[13], [14]])
    for b, nxt in enumerate([13, 14]):
        torch.testing.assert_close(logits[b, 0], recompute(model, seqs[b] + [nxt]), rtol=0, atol=ATOL)


def test_repeat_rows_shares_each_prefill_among_its_samples(model):
    prompts = [random_tokens(5, 40), random_tokens(8, 41)]
    cache = new_cache(model, 6, live_rows=2)
    append(model, cache, prompts)
    cache.commit(torch.tensor([5, 8]))
    cache.repeat_rows(3)
    assert cache.batch_size == 6 and cache.lengths.tolist() == [5, 5, 5, 8, 8, 8]
    nxt = [[t] for t in range(20, 26)]
    logits = append(model, cache, nxt)
    for row in range(6):
        torch.testing.assert_close(logits[row, 0], recompute(model, prompts[row // 3] + nxt[row]), rtol=0, atol=ATOL)


def test_repeat_rows_beyond_the_allocated_rows_raises(model):
    cache = new_cache(model, 4, live_rows=2)
    with pytest.raises(ValueError, match="cannot repeat 2 rows 3 times"):
        cache.repeat_rows(3)


def test_overflow_raises(model):
    cache = new_cache(model, 2, max_len=10)
    with pytest.raises(ValueError, match="overflow"):
        append(model, cache, [random_tokens(11, 50), random_tokens(3, 51)])
    append(model, cache, [random_tokens(8, 52), random_tokens(2, 53)])
    cache.commit(torch.tensor([8, 2]))
    append(model, cache, [[3, 4], [5, 6]])  # exactly full: allowed
    with pytest.raises(ValueError, match="overflow"):
        append(model, cache, [[3, 4, 5], [5, 6, 7]])
