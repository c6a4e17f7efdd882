"""Log-probabilities of response tokens under a policy, computed where they are needed only."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .phases import phase


class ResponseLogprobs(NamedTuple):
    logprobs: torch.Tensor  # [B, R] float32, log p(response token r | everything before it)
    mask: torch.Tensor  # [B, R] bool, real response tokens (R = longest response)
    entropy: torch.Tensor | None  # [B, R] float32 per-token entropy (0 beyond a response), if asked


class TokenLogprobs(torch.autograd.Function):
    """`log_softmax(logits / temperature)` at `targets`, and optionally the entropy, from [..., V] float32 logits.

    Autograd through logsumexp and gather keeps an exp(z - lse) buffer, a scattered one-hot and
    their sum, each as large as the logits; here the forward needs one such buffer (for the
    entropy) or none beyond logsumexp's, and the backward builds the softmax in the buffer that
    becomes the gradient. The entropy is a detached metric.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool):
        z = logits if temperature == 1.0 else logits / temperature
        if with_entropy:
            top = z.amax(dim=-1, keepdim=True)
            probs = torch.sub(z, top).exp_()
            total = probs.sum(dim=-1, keepdim=True)
            lse = (top + total.log()).squeeze(-1)
            # entr(p) = -p log p, 0 where p = 0 (a -inf logit), so no 0 * -inf.
            entropy = torch.special.entr(probs.div_(total), out=probs).sum(dim=-1)
            del probs
        else:
            lse = torch.logsumexp(z, dim=-1)
            entropy = None
        ctx.temperature = temperature
        ctx.save_for_backward(logits, targets, lse)
        logprobs = z.gather(-1, targets[..., None]).squeeze(-1) - lse
        entropy = torch.empty(0, device=logits.device) if entropy is None else entropy
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        scale = grad_logprobs[..., None] / ctx.temperature
        # d logp / dz = onehot(target) - softmax(z), z = logits / temperature.
        grad = (logits if ctx.temperature == 1.0 else logits / ctx.temperature).sub(lse[..., None]).exp_()
        grad.mul_(-scale).scatter_add_(-1, targets[..., None], scale)
        return grad, None, None, None


def sequence_logprobs(
    model,
    input_ids: torch.Tensor,
    prompt_lens: torch.Tensor,
    response_lens: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> ResponseLogprobs:
    """Per-token log-probs of the responses in right-padded `input_ids` [B, T].

    Row b holds `prompt_lens[b]` prompt tokens, then `response_lens[b]` response tokens, then
    padding. Right padding needs no attention mask: under causal attention real tokens never
    see the pads behind them, and positions 0..T-1 are already right for every row.

    Only the R = max(response_lens) positions that predict a response token go through the
    LM head, and the [B, R, V] logits are reduced in float32 (bf16 loses small
    probabilities) by `TokenLogprobs`: log p = z_token - logsumexp(z). `model` is a `CausalLM` or a DeepSpeed
    engine wrapping one. Entries beyond a row's response are 0 and masked.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
    if prompt_lens.min() < 1:
        raise ValueError("every row needs at least one prompt token to predict its first response token")
    if int((prompt_lens + response_lens).max()) > input_ids.shape[1]:
        raise ValueError("prompt_lens + response_lens exceed the width of input_ids")
    width = max(int(response_lens.max()), 1)
    offsets = torch.arange(width, device=input_ids.device)
    mask = offsets[None] < response_lens[:, None]
    # Position t predicts token t + 1; padding columns read the last position (masked anyway).
    predicts_at = (prompt_lens[:, None] - 1 + offsets[None]).clamp(max=input_ids.shape[1] - 1)
    targets = input_ids.gather(1, (predicts_at + 1).clamp(max=input_ids.shape[1] - 1))
    with phase("forward"):
        logits = model(input_ids, logits_at=predicts_at).logits
    with phase("logprobs"):
        logprobs, entropy = TokenLogprobs.apply(logits.float(), targets, temperature, with_entropy)
        logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
        entropy = torch.where(mask, entropy, torch.zeros_like(entropy)) if with_entropy else None
    return ResponseLogprobs(logprobs, mask, entropy)
