"""FlatWeights: a model's weights packed into one buffer per dtype, read back as views, copied in place."""
import pytest
import torch

from specroll.models import build_tiny_model
from specroll.models.flat_weights import ALIGN_BYTES, FlatWeights


def test_views_hold_every_weight_in_the_packed_dtype():
    model = build_tiny_model("llama", seed=0)
    state = model.state_dict()
    same = FlatWeights.pack(state).tensors()
    assert list(same) == list(state)
    assert all(torch.equal(same[k], state[k]) for k in state)
    halves = FlatWeights.pack(state, torch.bfloat16)
    assert list(halves.buffers) == ["bfloat16"]
    assert all(torch.equal(v, state[k].to(torch.bfloat16)) for k, v in halves.tensors().items())


def test_tied_weights_are_packed_once_and_read_as_one_tensor():
    model = build_tiny_model("qwen2", seed=0)  # ties the LM head to the embeddings
    weights = FlatWeights.pack(model.state_dict())
    tied = [slot for slot in weights.slots if len(slot.names) > 1]
    assert [slot.names for slot in tied] == [("embed_tokens.weight", "lm_head.weight")]
    views = weights.tensors()
    assert views["lm_head.weight"].data_ptr() == views["embed_tokens.weight"].data_ptr()
    untied_bytes = sum(v.numel() * 4 for v in model.state_dict().values())
    assert weights.nbytes < untied_bytes  # the shared matrix is not shipped twice


def test_every_tensor_starts_aligned():
    weights = FlatWeights.pack(build_tiny_model("qwen2", seed=0).state_dict())
    assert all(slot.offset % ALIGN_BYTES == 0 for slot in weights.slots)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_into_overwrites_the_model_in_place(model_type, dtype):
    source = build_tiny_model(model_type, seed=1)
    replica = build_tiny_model(model_type, seed=2).to(dtype)
    params_before = {name: p.data_ptr() for name, p in replica.named_parameters()}
    FlatWeights.pack(source.state_dict(), dtype).copy_into(replica)
    assert {name: p.data_ptr() for name, p in replica.named_parameters()} == params_before
    got = replica.state_dict()
    assert all(torch.equal(got[k], v.to(dtype)) for k, v in source.state_dict().items())
    if model_type == "qwen2":
        assert replica.lm_head.weight is replica.embed_tokens.weight


def test_copy_into_refuses_weights_of_another_model():
    weights = FlatWeights.pack(build_tiny_model("llama", seed=0).state_dict())
    with pytest.raises(ValueError, match=r"missing \['layers.0.self_attn.qkv_proj.bias', "
                                         r"'layers.1.self_attn.qkv_proj.bias'\], unexpected \[\]"):
        weights.copy_into(build_tiny_model("qwen2", seed=0))
    wider = build_tiny_model("llama", seed=3, intermediate_size=128)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(ValueError, match=r"weight layers.0.mlp.gate_up_proj.weight has shape \[128, 32\], "
                                         r"the model's is \[256, 32\]"):
        weights.copy_into(wider)
    assert all(torch.equal(v, before[k]) for k, v in wider.state_dict().items())  # refused before any copy


def test_packing_into_an_earlier_result_reuses_its_buffers():
    model = build_tiny_model("llama", seed=0)
    first = FlatWeights.pack(model.state_dict())
    pointers = {k: b.ctypes.data for k, b in first.buffers.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    again = FlatWeights.pack(model.state_dict(), into=first)
    assert again is first and {k: b.ctypes.data for k, b in again.buffers.items()} == pointers
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.tensors().items())
    # Another layout (here another dtype) gets buffers of its own.
    other = FlatWeights.pack(model.state_dict(), torch.bfloat16, into=first)
    assert other is not first and list(other.buffers) == ["bfloat16"]
