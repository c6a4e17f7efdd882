"""Activation checkpointing (`learner.activation_checkpointing`): the same loss and gradients for
a fraction of the memory, through the real learner, and never in a rollout's forward."""

from contextlib import contextmanager
from typing import NamedTuple

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from specroll.learner import GRPOLearner, GRPOSamples, LearnerConfig, sequence_logprobs
from specroll.models import KVCache, build_tiny_model
from specroll.rollout import SamplingParams
from specroll.rollout.decode_state import cache_shape
from specroll.rollout.plain_decoder import decode_one_token

# Wide and long enough that activations, not weights and their gradients, fill a step's memory.
SHAPE = dict(num_layers=8, hidden_size=128, intermediate_size=512, num_heads=8, num_kv_heads=2, head_dim=16,
             max_position_embeddings=1024)
ROWS, TOKENS, PROMPT_TOKENS = 2, 512, 128


def peak_allocated_bytes(prof) -> int:
    """Most tensor bytes allocated at once while `prof` recorded, above what was allocated before:
    the allocators' own allocation and free events, summed in time order."""
    # Read raw: the public `prof.events()` folds most of them into the ops that were running.
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


class TrainingStep(NamedTuple):
    loss: float
    grads: dict[str, torch.Tensor]
    peak_bytes: int  # `peak_allocated_bytes` of the forward and backward


def training_step(checkpointing: bool) -> TrainingStep:
    """One forward and backward of a response log-prob loss on a fresh model of `SHAPE`."""
    model = build_tiny_model(seed=0, init_std=0.1, **SHAPE).use_activation_checkpointing(checkpointing)
    ids = torch.randint(2, 64, (ROWS, TOKENS), generator=torch.Generator(torch.get_default_device()).manual_seed(0))
    prompt_lens = torch.full((ROWS,), PROMPT_TOKENS)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = sequence_logprobs(model, ids, prompt_lens, TOKENS - prompt_lens)
        loss = -(out.logprobs * torch.linspace(-1, 1, TOKENS - PROMPT_TOKENS)).mean()
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return TrainingStep(loss.item(), grads, peak_allocated_bytes(prof))


def test_checkpointing_gives_the_same_loss_and_gradients_for_a_fraction_of_the_memory():
    """Peak memory of a step's forward and backward (the guide's figure, printed with `-s`). What remains
    with checkpointing: every layer's input, one layer's recomputed activations, the gradients."""
    plain, recomputed = training_step(checkpointing=False), training_step(checkpointing=True)
    assert recomputed.loss == pytest.approx(plain.loss, rel=1e-6)
    for name, grad in plain.grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(recomputed.grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    ratio = plain.peak_bytes / recomputed.peak_bytes
    figure = (f"{plain.peak_bytes / 2**20:.1f} MiB without checkpointing, "
              f"{recomputed.peak_bytes / 2**20:.1f} MiB with ({ratio:.2f}x)")
    print(f"peak of the step: {figure}")
    assert ratio >= 3, figure


@contextmanager
def counting_layer_calls(model):
    """A list that gains an entry each time one of the model's decoder layers begins a forward:
    once each in forward, again in backward where a layer is recomputed."""
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model.layers]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def test_only_a_training_forward_recomputes_its_layers():
    model = build_tiny_model(seed=0, num_layers=8).use_activation_checkpointing()
    ids = torch.randint(0, 64, (2, 6))
    with counting_layer_calls(model) as calls:
        model(ids).logits.sum().backward()
    assert len(calls) == 2 * 8
    with counting_layer_calls(model) as calls, torch.no_grad():  # log-probs before an update, the reference's
        model(ids)
    assert len(calls) == 8
    cache = KVCache.for_model(model, *cache_shape(2, 8))
    with counting_layer_calls(model) as calls:
        model(ids, cache=cache).logits.sum().backward()
    assert len(calls) == 8


def higher_order_ops_traced(fn, *args) -> list[str]:
    """The higher-order ops (nested regions, checkpoints) in the graphs dynamo traces from `fn(*args)`."""
    graphs = []

    def record(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    # Floats as constants, as a compiled StepFunction sets them.
    with torch._dynamo.config.patch(specialize_float=True):
        torch.compile(fn, backend=record, fullgraph=True, dynamic=True)(*args)
    return [node.target.name() for graph in graphs for node in graph.graph.nodes
            if isinstance(node.target, torch._ops.HigherOrderOperator)]


def test_compiled_forwards_without_gradients_trace_alike_with_checkpointing_on():
    """The rollout's decode step (a KV cache, inference mode) and a log-prob forward under no_grad
    trace the same graphs with the flag on as off: nothing is checkpointed, nothing recompiles."""
    traced = {}
    for checkpointing in (False, True):
        model = build_tiny_model("qwen2", seed=0, num_layers=4).use_activation_checkpointing(checkpointing)
        rows = torch.zeros(2, dtype=torch.long)
        with torch.inference_mode():
            cache = KVCache.for_model(model, *cache_shape(2, 8))
            step = higher_order_ops_traced(
                decode_one_token, model.form, model, rows, cache, 8, rows, rows, SamplingParams())
        with torch.no_grad():
            logprobs_forward = higher_order_ops_traced(lambda ids: model(ids).logits, torch.randint(0, 64, (2, 6)))
        traced[checkpointing] = step, logprobs_forward
    assert traced[True] == traced[False] == (["invoke_subgraph"] * 4, ["invoke_subgraph"] * 4)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_the_learner_updates_alike_with_checkpointing(zero_stage):
    """One GRPO update through DeepSpeed (CPU, gloo) on an 8-layer model: the same loss, gradient
    norm and new weights with checkpointing as without."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    prompts = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in (5, 3, 7, 4)]
    responses = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in (9, 6, 4, 11)]
    samples = GRPOSamples(prompts, responses, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    runs = {}
    for checkpointing in (False, True):
        cfg = LearnerConfig(zero_stage=zero_stage, lr=1e-2, grad_clip=0.0, device=str(torch.get_default_device()),
                            max_response_len=16, max_seq_len=32, micro_batch_tokens=24,
                            activation_checkpointing=checkpointing)
        learner = GRPOLearner(build_tiny_model(seed=0, init_std=0.1, num_layers=8), cfg)
        with counting_layer_calls(learner.module) as calls:
            metrics = learner.update(samples)
        runs[checkpointing] = metrics, learner.policy_state_dict()[1], len(calls)
    (plain, plain_weights, plain_calls), (recomputed, recomputed_weights, recomputed_calls) = runs[False], runs[True]
    assert recomputed_calls == 2 * plain_calls  # every layer of every micro-batch, recomputed once in backward
    assert recomputed["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-6)
    assert recomputed["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-5)
    for name, weight in plain_weights.items():
        torch.testing.assert_close(recomputed_weights[name], weight, rtol=1e-5, atol=1e-7, msg=name)
