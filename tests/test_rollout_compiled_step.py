"""The fixed-shape decode step: compiled equals eager, no host reads per step, bucketing and
the bookkeeping cadence never change what is generated."""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specroll.models import KVCache, build_tiny_model
from specroll.rollout import RolloutEngine, SamplingParams
from specroll.rollout import plain_decoder as plain_decoder_module
from specroll.rollout.compiled_step import StepFunction, graphs_compiled
from specroll.rollout.decode_state import cache_shape, span_bucket
from specroll.rollout.engine import batch_bucket
from specroll.rollout.plain_decoder import decode_one_token
from specroll.speculation import SpeculationConfig, SpeculativeDecoder
from specroll.speculation.budgets import tree_gate
from specroll.speculation.budgets.hardware_profile import HardwareProfile

EOS_IDS = [1, 2, 3]
PROMPTS = [[5, 9, 13], [7, 8, 20, 21, 22, 23, 24, 25], [30, 31]]
# Ops whose result size or value the host must read: each is a sync on a GPU.
HOST_READ_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_consecutive",
                 "aten::_unique2", "aten::repeat_interleave"}
HOST_READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture(scope="module")
def model():
    # Responses end by themselves every ~20 tokens, so rows finish at many different steps.
    return build_tiny_model("llama", seed=0, init_std=0.2, eos_token_ids=EOS_IDS)


class HostReads(TorchDispatchMode):
    """Counts every op that makes the host wait for a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        bool_index = name.startswith("aten::index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()) if i is not None)
        if name in HOST_READ_OPS or bool_index:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_host_reads():
    """Host reads by aten op and by the tensor methods that read values on the host."""
    mode = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READ_METHODS}

    def counted(name, method):
        def wrapper(self, *args, **kwargs):
            mode.counts[name] += 1
            return method(self, *args, **kwargs)
        return wrapper

    for name, method in originals.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        with mode:
            yield mode.counts
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def test_batch_bucket_is_the_power_of_two_that_holds_the_live_rows_below_the_current_size():
    assert [batch_bucket(live, 64) for live in (64, 33, 32, 17, 16, 9, 2, 1)] == [64, 64, 32, 32, 16, 16, 2, 1]
    assert [batch_bucket(live, 48) for live in (48, 33, 32, 5)] == [48, 48, 32, 8]


def test_span_bucket_rounds_up_and_never_fills_the_cache():
    assert [span_bucket(need, 129) for need in (1, 64, 65, 128)] == [64, 64, 128, 128]
    # A bound past the last bucket (a finished row's tree accepted beyond its cap) stops below
    # the cache's size: a span that fills the cache would recompile a compiled step.
    assert [span_bucket(need, 129) for need in (129, 140)] == [128, 128]


def host_reads(engine: RolloutEngine, max_new_tokens: int) -> int:
    with counting_host_reads() as counts:
        out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=max_new_tokens, n=4, seed=1))
    assert "stop" in out.finish_reasons and "length" in out.finish_reasons
    return sum(counts.values())


def test_a_decode_step_reads_nothing_on_the_host(model):
    """With bookkeeping reads only at the start and the end, host reads per generate call do
    not grow with the number of steps: for the plain engine, and for the speculative one's
    plain steps and (`sync_free_trees`) tree steps sized on the host (fixed and concurrency
    budgets). Tree steps that read, the CPU default, are the control that shows the count sees reads."""
    def spec(**fields):
        return RolloutEngine(model, decoder=SpeculativeDecoder(model, SpeculationConfig(heads_path=None, **fields)),
                             sync_every=1000)

    engines = {"plain": RolloutEngine(model, sync_every=1000), "one-node spec": spec(budget="fixed", fixed_nodes=1),
               "fixed trees": spec(budget="fixed", fixed_nodes=4, sync_free_trees=True),
               "concurrency trees": spec(budget="concurrency", capacity=24, max_nodes=8, sync_free_trees=True)}
    for name, engine in engines.items():
        assert host_reads(engine, 12) == host_reads(engine, 36), f"a step of the {name} engine reads on the host"
    for reading in (spec(budget="fixed", fixed_nodes=4), spec(budget="fixed", fixed_nodes=4, sync_free_trees=True,
                                                              adaptation="reflex")):
        assert host_reads(reading, 36) > host_reads(reading, 12)


def test_the_tree_gate_reads_its_counts_once_per_read_period(model, tmp_path, monkeypatch):
    """Sync-free trees sized by a measured capacity read the gate's counts every READ_EVERY
    tree steps (and once when the call ends), not every step."""
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    spec = SpeculationConfig(heads_path=None, budget="concurrency", max_nodes=8, profile_cache_len=32,
                             sync_free_trees=True)
    engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, spec), sync_every=1000)
    decoder = engine.decoder
    # Trees half a plain step's cost: they pay whatever they emit, so every step is a tree.
    decoder.profile = HardwareProfile("m", "cpu", "float32", 32, [1, 4096], [1, 2, 4, 8],
                                      [[0.010, 0.005, 0.005, 0.005]] * 2, tree_form="trees")
    decoder.capacity = 24
    extra = host_reads(engine, 36) - host_reads(engine, 12)
    assert extra <= (36 - 12) // tree_gate.READ_EVERY + 1
    assert any(decoder.gate.tokens_per_row(b) is not None for b in decoder.gate.buckets)  # it did read them


def test_sync_free_tree_steps_generate_and_count_what_reading_every_step_does(model):
    """Tree steps with finished rows left in the batch between reads emit the same responses,
    and count the same tokens per pass, as tree steps on a batch compacted before every step."""
    params = SamplingParams(max_new_tokens=30, n=4, seed=3)
    specs = [SpeculationConfig(heads_path=None, budget="fixed", fixed_nodes=4, sync_free_trees=mode)
             for mode in (False, True)]
    outs = [RolloutEngine(model, decoder=SpeculativeDecoder(model, spec), sync_every=1000).generate(PROMPTS, params)
            for spec in specs]
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].finish_reasons == outs[1].finish_reasons
    assert outs[0].stats.active_rows_per_step == outs[1].stats.active_rows_per_step
    for key in ("tokens_per_step_hist", "acceptance_by_depth", "drafted_tokens", "drafted_response_steps",
                "budget_per_step", "verify_steps"):
        assert getattr(outs[0].stats.tree, key) == getattr(outs[1].stats.tree, key), key
    # Steps that ran after the last row finished, before the next read, are no steps.
    assert outs[1].stats.tree.verify_steps == len(outs[1].stats.active_rows_per_step) == outs[1].stats.steps
    # Every kept token after the first came out of a pass (a pass may emit past a stop token).
    assert outs[0].stats.tree.drafted_tokens >= sum(len(t) for t in outs[0].token_ids) - len(outs[0].token_ids)


@pytest.mark.parametrize("fixed_nodes", [3, 6])
def test_sync_free_trees_below_their_bucket_emit_what_reading_steps_do(model, fixed_nodes):
    """A sync-free tree of 3 or 6 nodes drafts for its 4- or 8-node bucket and keeps its best
    drafts: responses stay the reading steps' token for token (the lookup chain, drafted deeper,
    may choose other trees, so the acceptance statistics may differ)."""
    spec = partial(SpeculationConfig, heads_path=None, budget="fixed", fixed_nodes=fixed_nodes, max_nodes=8)
    for params in (SamplingParams(temperature=0.0, max_new_tokens=30, n=2), SamplingParams(max_new_tokens=30, n=4, seed=5)):
        reading, sync_free = (RolloutEngine(model, decoder=SpeculativeDecoder(model, spec(sync_free_trees=mode)))
                              .generate(PROMPTS, params) for mode in (False, True))
        assert reading.token_ids == sync_free.token_ids and reading.finish_reasons == sync_free.finish_reasons
        assert set(sync_free.stats.tree.budget_per_step) == {fixed_nodes}
        assert max(sync_free.stats.tree.tokens_per_step_hist) > 1


def test_bucketing_and_sync_cadence_never_change_the_output(model):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, n=3)
    sampled = SamplingParams(max_new_tokens=30, n=4, seed=5, top_p=0.9)
    for params in (greedy, sampled):
        outs = [RolloutEngine(model, sync_every=k).generate(PROMPTS, params) for k in (1, 4, 1000)]
        alone = [RolloutEngine(model, sync_every=1).generate([p], params, prompt_keys=[i]) for i, p in enumerate(PROMPTS)]
        for out in outs[1:] + [merge(alone)]:
            assert out.token_ids == outs[0].token_ids
            assert out.finish_reasons == outs[0].finish_reasons
            for a, b in zip(out.logprobs, outs[0].logprobs):
                assert a == pytest.approx(b, abs=1e-5)
        assert outs[0].stats.active_rows_per_step == outs[2].stats.active_rows_per_step


def merge(outs):
    first = outs[0]
    for out in outs[1:]:
        first.token_ids += out.token_ids
        first.logprobs += out.logprobs
        first.finish_reasons += out.finish_reasons
    return first


@pytest.mark.compile
def test_compiled_step_generates_what_the_eager_step_does(model):
    """torch.compile on a tiny model: greedy outputs identical, sampled ones too (the same
    uniforms; a reordered float sum moves a log-prob by ~1e-7, not a sample)."""
    eager, compiled = RolloutEngine(model, sync_every=4), RolloutEngine(model, compile=True, sync_every=4)
    for params in (SamplingParams(temperature=0.0, max_new_tokens=24, n=3), SamplingParams(max_new_tokens=24, n=3, seed=3)):
        a, b = eager.generate(PROMPTS, params), compiled.generate(PROMPTS, params)
        assert a.token_ids == b.token_ids and a.finish_reasons == b.finish_reasons
        for x, y in zip(a.logprobs, b.logprobs):
            assert x == pytest.approx(y, abs=1e-4)
        assert b.stats.compiles >= 1 and b.stats.compile_s > 0
    assert compiled.generate(PROMPTS, params).stats.compiles == 0, "a repeated call recompiles"


@pytest.mark.compile
def test_compiled_engines_of_models_of_other_forms_generate_their_own_tokens():
    """Compiled steps skip dynamo's guards on modules, so a graph traced for one model must not
    serve a model of another form (`specialise`): a Qwen2 and a Qwen3 model the Llama one's size,
    compiled after it in the same process, compile their own graphs and generate what they do
    eagerly (they ran the Llama graph before)."""
    torch._dynamo.reset()
    params = SamplingParams(temperature=0.0, max_new_tokens=16, n=2)
    for model_type in ("llama", "qwen2", "qwen3"):
        model = build_tiny_model(model_type, seed=2, num_layers=2, init_std=0.2)
        compiled = RolloutEngine(model, compile=True).generate(PROMPTS, params)
        assert compiled.stats.compiles >= 1, model_type  # not dynamo's eager fallback either
        assert compiled.token_ids == RolloutEngine(model).generate(PROMPTS, params).token_ids, model_type


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


def test_a_compiled_step_compiles_a_sweep_of_settings_past_dynamos_default_limit():
    """Floats are constants of a compiled step (a temperature, say), so each value is a graph of its
    own: a sweep of ten in one process compiles ten (dynamo's limit of 8 per function made the ninth
    raise, as a compiled engine did at its ninth temperature)."""
    step = StepFunction(scaled, True, torch.device("cpu"))
    for i in range(10):
        assert step(torch.ones(3), 0.5 + i).tolist() == [0.5 + i] * 3
    assert step.pop().compiles == 10


@pytest.mark.compile
@pytest.mark.parametrize("sync_free_trees", [False, True])
def test_compiled_verify_forward_generates_what_the_eager_one_does(model, sync_free_trees):
    """The speculative engine with compiled steps (tree verify forwards padded to node-count
    buckets, and the plain step), with tree steps that read and that do not (finished rows
    riding along, as on GPUs): greedy outputs identical to eager."""
    spec = SpeculationConfig(heads_path=None, budget="fixed", fixed_nodes=6, max_nodes=8, sync_free_trees=sync_free_trees)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, n=2)
    eager = RolloutEngine(model, decoder=SpeculativeDecoder(model, spec)).generate(PROMPTS, params)
    compiled = RolloutEngine(model, decoder=SpeculativeDecoder(model, spec, compile=True)).generate(PROMPTS, params)
    assert compiled.token_ids == eager.token_ids and compiled.finish_reasons == eager.finish_reasons
    assert compiled.stats.tree.verify_steps == eager.stats.tree.verify_steps


@pytest.mark.compile
@pytest.mark.parametrize("sync_free_trees", [False, True])
def test_a_compiled_decoder_compiles_up_front_what_it_runs(model, tmp_path, monkeypatch, sync_free_trees):
    """A compiled decoder compiles its graphs when built, and its hardware profile times them
    (cached apart from the eager profile), so generating compiles nothing: trees verified at
    batch 1 and above, with attended spans shorter than the cache, and (sync-free) drafted
    and judged at every node bucket and budget the concurrency budget gives. So does a decoder
    that finds the profile cached."""
    monkeypatch.setenv("SPECROLL_CACHE", str(tmp_path))
    spec = SpeculationConfig(heads_path=None, budget="concurrency", max_nodes=8, profile_cache_len=32,
                      sync_free_trees=sync_free_trees)
    for _ in ("measures the profile", "finds it cached"):
        engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, spec, compile=True))
        assert engine.decoder.profile.compiled
        engine.decoder.capacity = 16  # verify trees whatever C_hw the tiny model's timings gave
        engine.decoder.gate = None  # and whether they pay
        engine.decoder.compile_stats()  # what was compiled up front (nothing the second time, or after other tests)
        out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=80, n=2, seed=1))
        assert max(out.stats.tree.budget_per_step) > 1 and max(out.stats.tree.tokens_per_step_hist) > 1
        assert len(set(out.stats.tree.budget_per_step)) >= 3
        assert out.stats.compiles == 0


@pytest.mark.compile
def test_compiled_tree_steps_sized_on_the_host_generate_what_eager_ones_do(model):
    """Drafting and judging compiled beside the verify forward (sync-free tree steps, as on
    GPUs), under a concurrency budget whose trees change size as rows finish, after plain steps
    while many rows are live (on a GPU, drafting then reads a plain step's CUDA-graph output): greedy
    and sampled responses identical to eager, and so are the statistics the decoder counts."""
    spec = SpeculationConfig(heads_path=None, budget="concurrency", capacity=16, max_nodes=8, sync_free_trees=True)
    eager = RolloutEngine(model, decoder=SpeculativeDecoder(model, spec), sync_every=4)
    compiled = RolloutEngine(model, decoder=SpeculativeDecoder(model, spec, compile=True), sync_every=4)
    for params in (SamplingParams(temperature=0.0, max_new_tokens=24, n=3), SamplingParams(max_new_tokens=24, n=3, seed=3)):
        a, b = eager.generate(PROMPTS, params), compiled.generate(PROMPTS, params)
        assert a.token_ids == b.token_ids and a.finish_reasons == b.finish_reasons
        for x, y in zip(a.logprobs, b.logprobs):
            assert x == pytest.approx(y, abs=1e-4)
        for name in ("budget_per_step", "tokens_per_step_hist", "acceptance_by_depth", "lookup_token_share"):
            assert getattr(a.stats.tree, name) == getattr(b.stats.tree, name), name
        assert len(set(a.stats.tree.budget_per_step)) >= 2 and a.stats.tree.budget_per_step[0] == 1


def lone_rows(engine: RolloutEngine, params: SamplingParams):
    return merge([engine.generate([p], params, prompt_keys=[i]) for i, p in enumerate(PROMPTS)])


@pytest.mark.parametrize("spec", [None, SpeculationConfig(heads_path=None, budget="fixed", fixed_nodes=4, sync_free_trees=True)])
def test_a_lone_response_beside_a_finished_row_comes_out_as_alone(model, spec):
    """On a GPU a compiled engine keeps two rows (`compiled_min_rows`): a lone response runs
    beside a finished copy of itself, which emits nothing and is dropped from the output."""
    alone, beside = (RolloutEngine(model, decoder=None if spec is None else SpeculativeDecoder(model, spec))
                     for _ in range(2))
    beside.decoder.min_rows = 2
    for params in (SamplingParams(temperature=0.0, max_new_tokens=30), SamplingParams(max_new_tokens=30, seed=4)):
        a, b = lone_rows(alone, params), lone_rows(beside, params)
        assert a.token_ids == b.token_ids and a.finish_reasons == b.finish_reasons
        for x, y in zip(a.logprobs, b.logprobs):
            assert x == pytest.approx(y, abs=1e-5)
        one = beside.generate(PROMPTS[:1], params)
        assert set(one.stats.active_rows_per_step) == {1} and one.stats.tokens == len(one.token_ids[0])


@pytest.mark.compile
def test_a_compiled_step_kept_at_two_rows_compiles_one_graph(model):
    """Kept at two rows or more (a lone response, the tail of a batch), a compiled step never
    meets the one-row batch that torch.compile specialises on: one graph for every batch."""
    torch._dynamo.reset()  # graphs of this step compiled by earlier tests would be reused
    engine = RolloutEngine(model, compile=True, sync_every=2)
    engine.decoder.min_rows = 2
    compiles = 0
    for prompts, params in ((PROMPTS[:1], SamplingParams(max_new_tokens=12, seed=1)),
                            (PROMPTS, SamplingParams(max_new_tokens=40, n=2, seed=1))):
        out = engine.generate(prompts, params)
        compiles += out.stats.compiles
    assert min(out.stats.active_rows_per_step) == 1  # the batch's tail ran one live row
    assert compiles == 1


@pytest.mark.compile
def test_a_decoder_kept_at_two_rows_compiles_no_one_row_graphs_up_front(model, monkeypatch):
    """The GPU rule (`compiled_min_rows` 2), applied on a CPU: a compiled speculative decoder with
    sync-free trees compiles one graph per step function up front (the plain step, the verify
    forward, drafting, judging, and the engine's bookkeeping of one-token and tree steps), none
    for one row, and generating a lone response or a batch down to its last live row compiles
    nothing more."""
    monkeypatch.setattr(plain_decoder_module, "compiled_min_rows", lambda compiled_on_cuda: 2)
    torch._dynamo.reset()
    before = graphs_compiled()
    spec = SpeculationConfig(heads_path=None, budget="concurrency", capacity=16, max_nodes=8, sync_free_trees=True)
    engine = RolloutEngine(model, decoder=SpeculativeDecoder(model, spec, compile=True), sync_every=2)
    assert engine.decoder.min_rows == 2 and graphs_compiled() - before == 6
    engine.decoder.compile_stats()
    for prompts, params in ((PROMPTS[:1], SamplingParams(max_new_tokens=12, seed=1)),
                            (PROMPTS, SamplingParams(max_new_tokens=40, n=2, seed=1))):
        out = engine.generate(prompts, params)
        assert out.stats.compiles == 0 and max(out.stats.tree.budget_per_step) > 1
    assert min(out.stats.active_rows_per_step) == 1


def test_a_compiled_step_traces_one_decoder_layer_for_all_of_them():
    """Compiled, every decoder layer calls one nested region traced once (so compiling barely grows
    with depth), not a copy of the layer per layer (in a fresh process: on torch 2.11, a step compiled
    before with other cache sizes gives each layer's cache sizes of its own, and a region; see the guide)."""
    torch._dynamo.reset()
    model = build_tiny_model("qwen2", seed=0, num_layers=4)
    graphs = []

    def record(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    step = torch.compile(decode_one_token, backend=record, fullgraph=True, dynamic=True)
    rows = torch.zeros(2, dtype=torch.long)
    # Floats as constants, as a compiled StepFunction sets them (pytest's monkeypatch breaks dynamo's config).
    with torch.inference_mode(), torch._dynamo.config.patch(specialize_float=True):
        step(model.form, model, rows, KVCache.for_model(model, *cache_shape(2, 8)), 8, rows, rows, SamplingParams())
    (graph,) = graphs
    regions = [node.args[1] for node in graph.graph.nodes if node.target is torch.ops.higher_order.invoke_subgraph]
    assert len(regions) == 4 and len(set(regions)) == 1
