"""Hardware profile: verify latency over batch sizes x nodes per row, and C_hw.

C_hw is the largest total node count (rows x nodes) whose verify forward stays within
`slack` (1.25x) of a one-token decode step at batch 1. Profiles are cached per model,
device, dtype, cache length, whether the steps run compiled and what tree steps were timed,
so the engine measures once.
A compiled decoder has its profile time its own compiled steps (`timed_pass`): timing eager
forwards would make its (faster) plain step look slow and speculation look cheap. A decoder
whose tree steps read nothing on the host times whole tree steps (drafting and judging too:
`tree_form`); its C_hw is then measured from its cheapest tree step, and the tree gate
(`tree_gate.py`) weighs what trees cost beyond plain steps.

Command: python -m specroll.tools.profile --model smollm2-135m-instruct [--dtype float32]
"""
from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from specroll.models import KVCache, synchronize
from specroll.models.loading import cache_root
from specroll.rollout.decode_state import cache_shape
from specroll.storage import write_atomically

# Part of the cache key: bump it when the forward's kernels change what a profile measures
# (2: prepacked CPU linears, batch 64 in the quick grid).
PROFILE_VERSION = 2

QUICK_GRID = {"batch_sizes": [1, 4, 16, 64], "nodes": [1, 2, 4, 8, 16]}
FULL_GRID = {"batch_sizes": [1, 2, 4, 8, 16, 32, 64], "nodes": [1, 2, 4, 8, 16, 32]}


@dataclass
class HardwareProfile:
    model: str
    device: str
    dtype: str
    cache_len: int
    batch_sizes: list[int]
    nodes: list[int]
    latency_s: list[list[float]]  # [batch index][nodes index], median seconds
    slack: float = 1.25
    capacity: int = field(default=0)  # C_hw
    compiled: bool = False  # timed through the decoder's compiled steps
    # The tree steps that cells of more than one node time whole (drafting, verify forward,
    # judging: `speculation.warmup.tree_form`); empty: those cells time verify forwards.
    tree_form: str = ""

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in ("batch_sizes", "nodes", "latency_s"):
            # Memo of `latency`: the cost model asks for every tree size at every step, and
            # interpolating each time shows in a batch-1 step on a CPU. Replacing a table
            # clears it (tables are replaced, never edited in place); not a field, never saved.
            super().__setattr__("_latency_memo", {})

    @property
    def tree_steps(self) -> bool:
        return bool(self.tree_form)

    def latency(self, batch: int, nodes: int) -> float:
        """Seconds of a step of `batch` rows of `nodes` nodes each (a verify forward, or a whole
        tree step), interpolated in the grid.

        Past the largest profiled batch, a pass costs what the largest batch costs with the
        same total number of tokens (more nodes per row), extrapolated along the nodes axis
        if needed: holding the largest batch's cost would make extra nodes look as cheap
        there as at that batch, which they are not. Tree steps cost more than their tokens
        (drafting, judging), so there each column continues along the batch axis instead.
        """
        key = (batch, nodes)
        if key not in self._latency_memo:
            if batch > self.batch_sizes[-1] and not self.tree_steps:
                batch, nodes = self.batch_sizes[-1], nodes * batch / self.batch_sizes[-1]
            per_batch = [extrapolated_interp(nodes, self.nodes, row) for row in self.latency_s]
            self._latency_memo[key] = extrapolated_interp(batch, self.batch_sizes, per_batch)
        return self._latency_memo[key]

    def derive_capacity(self) -> int:
        """C_hw against a one-token step at batch 1, or (`tree_steps`) the smallest tree step there:
        a tree step's fixed cost beyond a plain one is the tree gate's to weigh, not capacity's."""
        smallest = min(n for n in self.nodes if n > 1) if self.tree_steps else 1
        base = self.latency(1, smallest)
        fits = [b * n for i, b in enumerate(self.batch_sizes) for j, n in enumerate(self.nodes)
                if self.latency_s[i][j] <= self.slack * base]
        return max(fits, default=1)

    @staticmethod
    def cache_path(model: str, device: str, dtype: str, cache_len: int, compiled: bool = False,
                   tree_form: str = "") -> Path:
        safe = model.replace("/", "_")
        steps = "-compiled" if compiled else ""
        if tree_form:  # other heads, tree sizes or drafting settings time other tree steps
            steps += "-trees-" + hashlib.sha256(tree_form.encode()).hexdigest()[:10]
        return cache_root() / "profiles" / f"{safe}-{device}-{dtype}{steps}-L{cache_len}-v{PROFILE_VERSION}.json"

    def save(self) -> Path:
        """Write the cache file atomically: engines profiling at once each leave a whole file."""
        path = self.cache_path(self.model, self.device, self.dtype, self.cache_len, self.compiled, self.tree_form)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, model: str, device: str, dtype: str, cache_len: int, compiled: bool = False,
             tree_form: str = "") -> "HardwareProfile | None":
        """The cached profile; None when there is none, or (with a warning naming the file) when it is damaged."""
        path = cls.cache_path(model, device, dtype, cache_len, compiled, tree_form)
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError, UnicodeDecodeError) as exc:  # cut short, not JSON, or other fields
            warnings.warn(f"hardware profile cache {path} is damaged ({exc}); measuring again", stacklevel=3)
            return None


def extrapolated_interp(x: float, xs: list[int], ys) -> float:
    """np.interp, continued linearly past the last point (not held flat)."""
    if x <= xs[-1] or len(xs) < 2:
        return float(np.interp(x, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (x - xs[-1]))


def eager_pass(model, ids: torch.Tensor, cache: KVCache, mask: torch.Tensor) -> None:
    """The model's eager forward over `ids` [B, n] with ancestor `mask` [B, n, n]."""
    model(ids, cache=cache, new_token_mask=mask)


@torch.inference_mode()
def measure_profile(model, cache_len: int = 256, batch_sizes=None, nodes=None, repeats: int = 5,
                    show_progress: bool = False, timed_pass=None, compiled: bool = False,
                    tree_form: str = "") -> HardwareProfile:
    """Median latency of a step per (batch, nodes) cell over `repeats` rounds of the whole grid.

    Rounds sweep every cell in turn, so a burst of load from elsewhere on a shared machine
    lands on all cells alike instead of skewing the few it happens to hit. `timed_pass(ids,
    cache, mask)` is the pass to time (a decoder's own steps, `compiled` or not; whole tree
    steps of `tree_form` where it is given); None: `eager_pass`. Each pass starts from
    `cache_len` cached tokens.
    """
    batch_sizes = batch_sizes or QUICK_GRID["batch_sizes"]
    nodes = nodes or QUICK_GRID["nodes"]
    model.use_prepacked_linears()  # measure the forward the rollout engine runs
    p = next(model.parameters())
    cfg = model.config
    caches = {}
    for batch in batch_sizes:
        caches[batch] = KVCache.for_model(model, *cache_shape(batch, cache_len + max(nodes)))  # as the engine's
        caches[batch].lengths[:] = cache_len
        if compiled and p.device.type == "cuda":
            caches[batch].mark_static()  # as the engine's cache for compiled steps
    timed_pass = timed_pass or partial(eager_pass, model)
    cells = [(bi, ni) for bi in range(len(batch_sizes)) for ni in range(len(nodes))]
    times = {cell: [] for cell in cells}
    rounds = range(repeats + 1)  # round 0 warms up and is dropped
    progress = tqdm(total=len(rounds) * len(cells), desc="profile", unit="pass", disable=not show_progress)
    for round_index in rounds:
        for bi, ni in cells:
            batch, n = batch_sizes[bi], nodes[ni]
            ids = torch.randint(0, cfg.vocab_size, (batch, n), device=p.device)
            # A chain is the worst case for nothing and the same cost as any tree of n nodes.
            # Contiguous like the engine's masks (a compiled step guards on strides).
            mask = torch.ones(n, n, dtype=torch.bool, device=p.device).tril().repeat(batch, 1, 1)
            caches[batch].lengths[:] = cache_len  # a tree step keeps what it accepted
            synchronize(p.device)
            t0 = time.perf_counter()
            timed_pass(ids, caches[batch], mask)
            synchronize(p.device)
            if round_index > 0:
                times[(bi, ni)].append(time.perf_counter() - t0)
            progress.update()
    progress.close()
    table = [[float(np.median(times[(bi, ni)])) for ni in range(len(nodes))] for bi in range(len(batch_sizes))]
    prof = HardwareProfile(cfg.name or "unnamed", p.device.type, str(p.dtype).removeprefix("torch."),
                           cache_len, list(batch_sizes), list(nodes), table, compiled=compiled, tree_form=tree_form)
    prof.capacity = prof.derive_capacity()
    return prof


def get_profile(model, cache_len: int = 256, timed_pass=None, compiled: bool = False, tree_form: str = "",
                max_nodes: int | None = None) -> HardwareProfile:
    """The cached profile for this model / device / dtype, or a quick measurement (then cached).
    `timed_pass(ids, cache, mask)`: a decoder's own steps (`compiled`; whole tree steps of
    `tree_form` where it is given), timed instead of the eager forward; `max_nodes`: the
    most nodes per row a cell times (a decoder's largest tree), default the grid's."""
    p = next(model.parameters())
    dtype = str(p.dtype).removeprefix("torch.")
    name = model.config.name or "unnamed"
    prof = HardwareProfile.load(name, p.device.type, dtype, cache_len, compiled, tree_form)
    if prof is None:
        nodes = sorted({min(n, max_nodes or n) for n in QUICK_GRID["nodes"]})
        prof = measure_profile(model, cache_len, nodes=nodes, timed_pass=timed_pass, compiled=compiled,
                               tree_form=tree_form)
        if model.config.name:
            prof.save()
    return prof
