"""A step function run compiled (torch.compile on every device, CUDA graphs on GPUs) or eager.

The functions wrapped here take fixed shapes (batch and attended span bucketed by the
caller) and never read a tensor on the host, so one compiled graph (dynamic in those sizes)
serves every step, and on a GPU a step of each shape replays as one CUDA graph (as in
gpt-fast). A model's layers compile once for all of them (`DecoderLayer` is a nested compile
region). Inductor caches compiled kernels on disk (`TORCHINDUCTOR_CACHE_DIR`), so later runs
compile faster.
"""
from __future__ import annotations

import time

import torch

from .stats import CompileStats


def specialise(form: str) -> None:
    """What a compiled step calls first: its graphs then serve `form` alone.

    Compiled steps skip dynamo's guards on modules (hundreds, checked before every step; a run
    updates weights in place), so a graph traced for one model would serve another. A step
    therefore reads a string naming what its code depends on besides tensor values (the model's
    `form`, the heads'), and dynamo guards on that instead. The string must come in as an argument:
    read through a module inside the step, its guard would be skipped with the module's.
    """
    if not form:
        raise ValueError("a compiled step needs the form of the modules it runs")


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class StepFunction:
    """`fn`, compiled when `compiled`; records the seconds spent in calls that compiled a graph."""

    def __init__(self, fn, compiled: bool, device: torch.device, cuda_graphs: bool = True) -> None:
        self.compiled = compiled
        self.cuda_graphs = torch.device(device).type == "cuda" and cuda_graphs  # replayed as CUDA graphs when compiled
        self.compile_s = 0.0  # wall time of the calls that compiled (tracing, codegen, the first run)
        self.compiles = 0
        if compiled:
            # Floats (sampling temperature, norm epsilons) are constants of a graph, as before torch 2.6:
            # a float traced as a variable cannot enter a nested compile region (torch 2.13).
            torch._dynamo.config.specialize_float = True
            # Each model form and sampling setting is a graph of its own: allow a sweep of them in one
            # process (past the limit, a step compiled with fullgraph raises).
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            # On GPUs, CUDA graphs (one per shape: mode "reduce-overhead") unless `cuda_graphs` is off
            # (a graph replays fixed addresses); on a CPU there are none to capture. Dynamic sizes:
            # one graph serves every batch bucket and attended span.
            # The model's modules never change during a run (weights are updated in place), so
            # their hundreds of guards, checked before every step, are skipped.
            options = {"triton.cudagraphs": self.cuda_graphs,
                       "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
            self.fn = torch.compile(fn, fullgraph=True, dynamic=True, options=options)
        else:
            self.fn = fn

    def __call__(self, *args, begins_step: bool = True):
        """`fn(*args)`. A call that does not begin a step runs after others of the same step whose
        outputs it reads: on a GPU their CUDA graphs' outputs must then stay alive."""
        if not self.compiled:
            return self.fn(*args)
        if self.cuda_graphs and begins_step:
            # Outputs of the previous step's replays have been consumed: their buffers may be reused.
            torch.compiler.cudagraph_mark_step_begin()
        before, started = graphs_compiled(), time.perf_counter()
        out = self.fn(*args)
        if graphs_compiled() != before:
            self.compile_s += time.perf_counter() - started
            self.compiles += 1
        return out

    def pop(self) -> CompileStats:
        """Graphs compiled since the last pop and the seconds of the calls that compiled them."""
        out = CompileStats(self.compile_s, self.compiles)
        self.compile_s, self.compiles = 0.0, 0
        return out
