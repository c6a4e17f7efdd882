"""Response log-probs against a direct full-sequence log-softmax, per row and padded."""

import pytest
import torch

from specroll.grpo import entropy_from_logits
from specroll.learner import GRPOSamples, pad_samples, sequence_logprobs
from specroll.learner.logprobs import TokenLogprobs
from specroll.models import build_tiny_model


def direct_logprobs(model, prompt, response, temperature=1.0):
    """Unpadded reference: full logits of one sequence, float64 log-softmax."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0].double() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)], logits[positions]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_padded_batch_matches_each_sequence_alone(temperature):
    model = build_tiny_model(init_std=0.2).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (3, 1, 6)]
    responses = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 2, 4)]
    mb = pad_samples(GRPOSamples(prompts, responses, torch.zeros(3)), [0, 1, 2])
    with torch.no_grad():
        out = sequence_logprobs(model, mb.input_ids, mb.prompt_lens, mb.response_lens, temperature, with_entropy=True)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (3, 5)
    assert out.mask.tolist() == mb.response_mask.tolist()
    all_logits = []
    for row, (p, r) in enumerate(zip(prompts, responses)):
        expected, logits = direct_logprobs(model, p, r, temperature)
        torch.testing.assert_close(out.logprobs[row, : len(r)].double(), expected, atol=1e-5, rtol=0)
        assert (out.logprobs[row, len(r) :] == 0).all()
        all_logits.append(logits)
    # The entropy is per response position, 0 beyond each response.
    assert out.entropy.shape == (3, 5) and (out.entropy[~out.mask] == 0).all()
    for row, logits in enumerate(all_logits):
        for t in range(logits.shape[0]):
            expected_entropy = entropy_from_logits(logits[None, t : t + 1], torch.ones(1, 1, dtype=torch.bool))
            torch.testing.assert_close(out.entropy[row, t].double(), expected_entropy.double(), atol=1e-5, rtol=0)


def test_gradient_reaches_the_weights_and_bf16_is_reduced_in_float32():
    model = build_tiny_model(init_std=0.2).to(torch.bfloat16)
    mb = pad_samples(GRPOSamples([[1, 2], [3]], [[4, 5, 6], [7]], torch.zeros(2)), [0, 1])
    out = sequence_logprobs(model, mb.input_ids, mb.prompt_lens, mb.response_lens)
    assert out.logprobs.dtype == torch.float32 and out.entropy is None
    out.logprobs.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_rejects_rows_without_a_prompt_token():
    model = build_tiny_model()
    with pytest.raises(ValueError, match="at least one prompt token"):
        sequence_logprobs(model, torch.zeros(1, 3, dtype=torch.long), torch.tensor([0]), torch.tensor([3]))


@pytest.mark.parametrize("temperature, with_entropy", [(1.0, False), (1.0, True), (0.7, True)])
def test_token_logprobs_match_autograd_through_log_softmax(temperature, with_entropy):
    gen = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(2, 5, 11, generator=gen)).requires_grad_()
    logits.data[1, 2, 4] = float("-inf")  # a banned token: probability 0, no NaN
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    targets[1, 2] = 7
    weights = torch.randn(2, 5, generator=gen)

    logprobs, entropy = TokenLogprobs.apply(logits, targets, temperature, with_entropy)
    (logprobs * weights).sum().backward()

    reference = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(reference / temperature, dim=-1)
    expected = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    (expected * weights.double()).sum().backward()
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits.grad.double(), reference.grad, atol=1e-5, rtol=1e-5)
    assert logits.grad[1, 2, 4] == 0
    if with_entropy:
        probs = logp_all.exp()
        want = -(probs * torch.where(probs > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
        torch.testing.assert_close(entropy.double(), want, atol=1e-5, rtol=0)
        assert not entropy.requires_grad
