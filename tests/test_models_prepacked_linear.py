"""The prepacked CPU linear: same products as `F.linear`, never stale, off where it must be."""
from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch
import torch.nn.functional as F

from specroll.models import CausalLM, tiny_config
from specroll.models import prepacked_linear
from specroll.models.prepacked_linear import PackedWeight, PrepackedLinear, linear_by_packed_copy, packed_copy, packed_linear


def packed_layer(bias: bool = True, seed: int = 0) -> PrepackedLinear:
    torch.manual_seed(seed)
    layer = PrepackedLinear(24, 40, bias=bias)
    layer.prepacked = True
    return layer


def test_matches_f_linear_for_any_row_count_and_layout():
    layer = packed_layer()
    with torch.no_grad():
        for shape in [(1, 24), (3, 24), (2, 7, 24), (64, 24)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        x = torch.randn(5, 3, 24).transpose(0, 1)  # not contiguous
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert packed_copy(layer.weight) is not None  # the packed path really ran


def test_repacks_after_in_place_update_and_new_storage():
    layer = packed_layer(bias=False)
    x = torch.randn(4, 24)
    with torch.no_grad():
        layer(x)
        layer.load_state_dict({"weight": torch.randn(40, 24)})  # weight sync copies in place
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(40, 24))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_gradients_flow_through_the_plain_path():
    layer = packed_layer()
    x = torch.randn(3, 24, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


def test_unpackable_dtype_falls_back_to_f_linear():
    layer = packed_layer().to(torch.bfloat16)  # packing bf16 needs CPU support some machines lack
    x = torch.randn(2, 24, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_model_logits_unchanged_by_prepacking():
    torch.manual_seed(0)
    model = CausalLM(tiny_config("qwen2")).eval()  # qwen2: q/k/v carry a bias
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        plain = model(ids).logits
        packed = model.use_prepacked_linears()(ids).logits
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-5)
    assert all(m.prepacked for m in model.modules() if isinstance(m, PrepackedLinear))


def test_packed_weight_never_mistakes_a_new_tensor_for_the_packed_one():
    cache = PackedWeight()
    first = torch.randn(40, 24)
    cache.get((first,), lambda: first)
    del first  # its address may be reused by the next allocation, with the same version 0
    second = torch.randn(40, 24)
    x = torch.randn(3, 24)
    torch.testing.assert_close(packed_linear(x, cache.get((second,), lambda: second)), F.linear(x, second),
                               rtol=1e-5, atol=1e-5)


def test_the_op_never_multiplies_by_a_freed_weights_copy():
    x = torch.randn(3, 24)
    first = torch.randn(40, 24)
    linear_by_packed_copy(x, first)
    key = id(first)
    del first
    others = [torch.randn(40, 24) for _ in range(100)]
    second = next((t for t in others if id(t) == key), None)  # its id, at the same version 0
    if second is None:
        pytest.skip("no new tensor took the freed one's id")
    torch.testing.assert_close(linear_by_packed_copy(x, second), F.linear(x, second), rtol=1e-5, atol=1e-5)


def test_the_op_with_a_fresh_copy_calls_only_the_onednn_op_in_python():
    """A step makes over a hundred of these calls: each Python call costs, and on Python
    3.11-3.12 one on a data-stack chunk boundary maps and unmaps a chunk every time."""
    x, weight = torch.randn(3, 24), torch.randn(40, 24)
    linear_by_packed_copy(x, weight)  # packs
    calls = []
    profiler = sys.getprofile()
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code) if event == "call" else None)
    try:
        linear_by_packed_copy(x, weight)
    finally:
        sys.setprofile(profiler)
    ours = [code.co_name for code in calls if code.co_filename == prepacked_linear.__file__]
    assert ours == ["linear_by_packed_copy"] and len(calls) <= 2  # the other: the op's OpOverload.__call__


def test_inference_tensors_go_through_f_linear():
    with torch.inference_mode():
        weight, x = torch.randn(40, 24), torch.randn(3, 24)
        torch.testing.assert_close(linear_by_packed_copy(x, weight), F.linear(x, weight))
    assert packed_copy(weight) is None  # no version counter to notice an update by: never packed


def test_a_used_packed_layer_can_be_deep_copied_and_pickled():
    layer = packed_layer()
    x = torch.randn(3, 24)
    with torch.no_grad():
        expected = layer(x)
        for copy_ in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            torch.testing.assert_close(copy_(x), expected)


def test_compiled_layer_matches_f_linear_and_follows_weight_updates():
    """Compiled, one row is a streamed reduction over the weight and several rows go through the
    packed copy (an op inductor leaves alone); both see an in-place weight update."""
    layer = packed_layer()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for shape in [(1, 24), (1, 1, 24), (5, 24), (2, 3, 24)]:
            x = torch.randn(*shape)
            out = compiled(x)
            assert out.shape == (*shape[:-1], 40)
            torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.load_state_dict({"weight": torch.randn(40, 24), "bias": torch.randn(40)})
        for shape in [(1, 24), (5, 24)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert packed_copy(layer.weight) is not None


def test_packed_copy_is_dropped_with_its_weight():
    weight = torch.randn(40, 24)
    linear_by_packed_copy(torch.randn(3, 24), weight)
    key = id(weight)
    assert key in prepacked_linear._packed_by_weight
    del weight
    assert key not in prepacked_linear._packed_by_weight
