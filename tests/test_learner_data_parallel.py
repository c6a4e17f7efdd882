"""Two data-parallel ranks (separate processes, gloo) take the same step as one process on the
whole batch, although their shards split into different numbers of micro-batches; every tensor
reduced on the way is on the process group's device."""

import os

import pytest
import torch
import torch.distributed

from gloo_ranks import run_two_ranks
from specroll.grpo import PolicyLossConfig, policy_loss
from specroll.learner import GRPOSamples, micro_batch_indices, pad_samples, sequence_logprobs
from specroll.models import build_tiny_model

LR, ADAM_EPS, BUDGET = 1e-2, 1.0, 12
# Weights near 1.0 (the norms) are stored with float32 spacing 1.2e-7.
WEIGHT_ATOL = 2e-7
# ZeRO-2 reduces gradients in every backward, ZeRO-3 also gathers weights in every forward:
# both hang unless the ranks run the same number of micro-batches.
ZERO_STAGES = (2, 3)


def shard_samples() -> list[GRPOSamples]:
    """Rank 0 gets short sequences (one micro-batch), rank 1 long ones (several)."""
    gen = torch.Generator().manual_seed(0)

    def make(prompt_len, response_lens):
        prompts = [torch.randint(2, 64, (prompt_len,), generator=gen).tolist() for _ in response_lens]
        responses = [torch.randint(2, 64, (n,), generator=gen).tolist() for n in response_lens]
        return GRPOSamples(prompts, responses, torch.randn(len(response_lens), generator=gen))

    return [make(1, [1, 2, 1]), make(3, [7, 5, 8])]


def record_all_reduce_devices() -> list[tuple[str, torch.dtype]]:
    """Wraps torch.distributed.all_reduce, which ours and DeepSpeed's reductions reach, to note each
    tensor's device and dtype (ours are float64) as the rank calls it."""
    seen = []
    all_reduce = torch.distributed.all_reduce

    def recording(tensor, *args, **kwargs):
        seen.append((str(tensor.device), tensor.dtype))
        return all_reduce(tensor, *args, **kwargs)

    torch.distributed.all_reduce = recording
    return seen


def run_rank(rank: int, out_dir: str) -> None:
    from specroll.learner import GRPOLearner, LearnerConfig, latest_checkpoint, load_checkpoint, save_checkpoint
    from specroll.learner.collectives import collective_device

    reduced = record_all_reduce_devices()

    for zero_stage in ZERO_STAGES:
        cfg = LearnerConfig(
            zero_stage=zero_stage, lr=LR, adam_eps=ADAM_EPS, grad_clip=0.0, micro_batch_tokens=BUDGET, device="cpu"
        )
        learner = GRPOLearner(build_tiny_model(), cfg)
        metrics = learner.update(shard_samples()[rank])
        version, weights = learner.policy_state_dict()
        root = os.path.join(out_dir, f"ckpt{zero_stage}")
        save_checkpoint(learner, root, step=1)
        state = load_checkpoint(learner, latest_checkpoint(root))
        result = {"metrics": metrics, "version": version, "weights": weights, "resumed_step": state.step,
                  "reduced": list(reduced), "collective_device": str(collective_device())}
        reduced.clear()
        torch.save(result, os.path.join(out_dir, f"stage{zero_stage}_rank{rank}.pt"))


def test_two_ranks_match_one_process_on_the_whole_batch(tmp_path):
    shards = shard_samples()
    counts = [len(micro_batch_indices(s.sequence_lengths(), list(range(len(s))), BUDGET)) for s in shards]
    assert counts[0] == 1 and counts[1] >= 3

    # One spawn for both stages: starting the processes costs more than the steps.
    run_two_ranks(run_rank, str(tmp_path))

    # Oracle: plain autograd over both shards as one batch, then AdamW's first step by hand.
    whole = GRPOSamples(
        shards[0].prompt_ids + shards[1].prompt_ids,
        shards[0].response_ids + shards[1].response_ids,
        torch.cat([shards[0].advantages, shards[1].advantages]),
    )
    model = build_tiny_model()
    mb = pad_samples(whole, list(range(len(whole))))
    out = sequence_logprobs(model, mb.input_ids, mb.prompt_lens, mb.response_lens)
    loss, _ = policy_loss(out.logprobs, out.logprobs.detach(), mb.advantages, out.mask, PolicyLossConfig())
    loss.backward()
    results = [
        torch.load(tmp_path / f"stage{stage}_rank{rank}.pt", weights_only=False) for stage in ZERO_STAGES for rank in range(2)
    ]
    initial = build_tiny_model().state_dict()
    for result in results:
        assert result["version"] == 1 and result["resumed_step"] == 1
        assert result["metrics"]["train/loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
        assert result["metrics"]["train/num_sequences"] == 6
        assert {device for device, _ in result["reduced"]} == {result["collective_device"]}
        assert torch.float64 in {dtype for _, dtype in result["reduced"]}
        for name, p in model.named_parameters():
            expected = -LR * p.grad / (p.grad.abs() + ADAM_EPS)
            torch.testing.assert_close(result["weights"][name] - initial[name], expected, rtol=1e-4, atol=WEIGHT_ATOL)
