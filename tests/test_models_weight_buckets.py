"""BucketPlan: a model's tensors cut into fixed-size byte buckets, hand-worked; packed and unpacked bitwise."""
import pytest
import torch
from torch import nn

from specroll.models import build_tiny_model
from specroll.models.weight_buckets import BucketPlan, pack_bucket, unpack_bucket


class Three(nn.Module):
    """A 10-float vector, a 100-float matrix tied under two names, and a 4-int64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.arange(10.0))
        self.b = nn.Linear(10, 10, bias=False)
        self.c = self.b  # tied: one tensor, two names
        self.register_buffer("steps", torch.arange(4))


def test_whole_tensors_fill_buckets_in_order_and_a_larger_one_goes_alone():
    # State-dict order: a, steps, b.weight (= c.weight). In bf16 a is 20 bytes -> 64 aligned;
    # steps stays int64: 32 -> 64; b is 200 -> 256, larger than a bucket, so alone.
    plan = BucketPlan.of(Three(), torch.bfloat16, bucket_bytes=128)
    assert [[s.names for s in b.slots] for b in plan.buckets] == [[("a",), ("steps",)], [("b.weight", "c.weight")]]
    assert [[s.offset for s in b.slots] for b in plan.buckets] == [[0, 64], [0]]
    assert [b.nbytes for b in plan.buckets] == [128, 256] and plan.largest == 256 and plan.nbytes == 384
    assert [s.dtype for b in plan.buckets for s in b.slots] == ["bfloat16", "int64", "bfloat16"]
    together = BucketPlan.of(Three(), None, bucket_bytes=1024)  # float32: 64 + 64 + 448 bytes
    assert len(together.buckets) == 1 and [s.offset for s in together.buckets[0].slots] == [0, 64, 128]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_packed_bucket_by_bucket_unpacks_bitwise_into_a_replica_of_its_dtype(dtype):
    source, replica = build_tiny_model("qwen2", seed=0), build_tiny_model("qwen2", seed=1).to(dtype)
    plan = BucketPlan.of(source, dtype, bucket_bytes=4096)
    plan.check(replica)
    buffer, targets, tensors = torch.empty(plan.largest, dtype=torch.uint8), replica.state_dict(), source.state_dict()
    for bucket in plan.buckets:
        unpack_bucket(bucket, pack_bucket(bucket, tensors, buffer), targets)
    assert len(plan.buckets) > 3
    assert all(torch.equal(replica.state_dict()[k], v.to(dtype)) for k, v in tensors.items())


def test_a_plan_for_another_model_is_refused_naming_the_difference():
    plan = BucketPlan.of(build_tiny_model("llama", seed=0), torch.float32, 2**20)
    with pytest.raises(ValueError, match=r"missing \[.*\], unexpected \["):
        plan.check(build_tiny_model("qwen2", seed=0))
