"""A speculative decoder's steps run before any generate call: compiled up front, and timed for
its hardware profile, on filler decode states.

`decoder` below is a `SpeculativeDecoder` (its module imports this one).
"""
from __future__ import annotations

import warnings
from functools import partial

import torch

from specroll.models import KVCache
from specroll.rollout.decode_state import DecodeState, cache_shape, span_bucket
from specroll.rollout.sampling import RowRandom, SamplingParams
from specroll.rollout.token_history import TokenHistory

from .budgets.hardware_profile import HardwareProfile, get_profile
from .config import SpeculationConfig
from .drafting.heads import HorizonHeads


def filler_state(model, cache: KVCache, batch: int, cached: int, history_slots: int) -> DecodeState:
    """A decode state of `batch` rows of `cached` tokens each, in `cache` (its lengths set) and in
    histories of `history_slots`, to compile or time steps on."""
    device = next(model.parameters()).device
    history = TokenHistory.from_prompts([[0] * cached] * batch, history_slots, device)
    cache.lengths.fill_(cached)
    last_hidden = torch.zeros(batch, model.config.hidden_size, device=device, dtype=next(model.parameters()).dtype)
    return DecodeState(cache, history, torch.arange(batch, device=device), RowRandom(0, list(range(batch)), device),
                       torch.zeros(batch, dtype=torch.long, device=device), last_hidden, SamplingParams())


def tree_form(heads: HorizonHeads, depth: int, cfg: SpeculationConfig) -> str:
    """What a sync-free tree step's cost depends on besides the model: the heads, the trees' depth
    where it is not the heads' (their form holds theirs) and the tree's settings."""
    lookup = cfg.lookup_ngram if cfg.context_lookup else 0
    shallower = f" depth={depth}" if depth != heads.num_heads else ""
    return (f"{heads.form}{shallower} max_nodes={cfg.max_nodes} children={cfg.max_children} "
            f"frontier={cfg.max_frontier} lookup={lookup}")


def profiled_pass(decoder, ids: torch.Tensor, cache, mask: torch.Tensor) -> None:
    """One hardware-profile cell through `decoder`'s own steps: the plain step (sampling at the
    default temperature 1) for one node per row, the verify forward for a chain of more."""
    if ids.shape[0] < decoder.min_rows:  # a lone row runs beside a finished one: time that
        ids, mask = ids.repeat(decoder.min_rows, 1), mask.repeat(decoder.min_rows, 1, 1)
    batch, nodes = ids.shape
    span = span_bucket(int(cache.lengths[:batch].max()) + nodes, cache.max_len)
    model = decoder.model
    if nodes == 1:
        keys, counters = (torch.zeros(batch, dtype=torch.long, device=ids.device) for _ in range(2))
        decoder.plain.decode(model.form, model, ids[:, 0], cache, span, keys, counters, SamplingParams())
    else:
        positions = cache.lengths[:batch, None] + torch.arange(nodes, device=ids.device)
        decoder.verify_forward(model.form, model, ids, positions, cache, mask, span)


def profiled_steps(decoder):
    """What a hardware profile of sync-free trees times: `profiled_pass` for one node, else a
    whole tree step, on a state per profiled cache, made in the profile's first round (untimed)."""
    cached, states = decoder.cfg.profile_cache_len, {}

    def timed(ids: torch.Tensor, cache, mask: torch.Tensor) -> None:
        if ids.shape[1] == 1:
            return profiled_pass(decoder, ids, cache, mask)
        if id(cache) not in states:
            batch = max(ids.shape[0], decoder.min_rows)
            states[id(cache)] = filler_state(decoder.model, cache, batch, cached, cached + decoder.cfg.max_nodes)
        state = states[id(cache)]
        state.cached_bound = cached  # the profile restores the cache's lengths before each pass
        decoder.sync_free_tree_step(state, ids.shape[1])
    return timed


def decoder_profile(decoder, compile: bool) -> HardwareProfile:
    """The (cached) hardware profile of `decoder`'s steps, `compile`d or not. Sync-free trees are
    timed whole, so their profile weighs drafting and judging too."""
    cfg = decoder.cfg
    trees = decoder.sync_free is not None and decoder.sync_free.buckets
    form = tree_form(decoder.heads, decoder.depth, cfg) if trees else ""
    timed = profiled_steps(decoder) if form else partial(profiled_pass, decoder) if compile else None
    return get_profile(decoder.model, cfg.profile_cache_len, timed, compile, form, cfg.max_nodes if form else None)


@torch.inference_mode()
def compile_steps(decoder) -> None:
    """Compile every graph decoding meets (the plain step, the verify forward and, for sync-free
    tree steps, drafting and judging, at batch 1 where it runs and above) now: lazily, the first
    tree of a run would stall it for minutes on a CPU."""
    device = next(decoder.model.parameters()).device
    if device.type == "cuda" and decoder.sync_free is None:
        warnings.warn("compiled on a GPU, plain decoding outruns tree steps that read on the host (the cost "
                      "model, Reflex, head records: they draft and verify eagerly around a compiled forward; "
                      "docs/guide.md, Compiled decoding): rollout=vanilla is faster there")
    # Sizes that equal no other (5 cache rows, batch 2, 4 nodes, 11 history slots; 3 lookup n-grams
    # and 4 heads by default): dynamo would otherwise assume that two sizes it saw equal always
    # are, and recompile when they are not.
    cache = KVCache.for_model(decoder.model, *cache_shape(4, 4))
    if device.type == "cuda":
        cache.mark_static()  # as the engine's
    batches = range(decoder.min_rows, 3)  # batch 1 and above, or only above (`compiled_min_rows`)
    for batch in batches:
        for nodes in (1, 4):
            ids = torch.zeros(batch, nodes, dtype=torch.long, device=device)
            mask = torch.ones(nodes, nodes, dtype=torch.bool, device=device).tril().repeat(batch, 1, 1)
            profiled_pass(decoder, ids, cache, mask)
    if decoder.sync_free is not None:
        for batch in batches:
            state = filler_state(decoder.model, cache, batch, 3, 11)
            for nodes in decoder.sync_free.buckets:
                decoder.sync_free_tree_step(state, nodes)
