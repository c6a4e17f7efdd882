"""GRPO samples -> padded tensors, grouped into token-budgeted micro-batches.

A mini-batch (one optimizer step) is split into micro-batches of at most
`micro_batch_tokens` padded tokens. Sequences are sorted by length first so each
micro-batch holds similar lengths and padding stays small. The mini-batch's
`loss_normalizer` (its total valid tokens for token-mean) is handed to every micro-batch's
loss, so the accumulated micro-batch gradients equal the full mini-batch gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from specroll.grpo import PolicyLossConfig, aggregation_denominator, check_rewards, group_advantages, valid_token_mask


@dataclass
class GRPOSamples:
    """One rollout batch: per response, its prompt, tokens, advantage and truncation flag.

    Responses are group-major when built by `from_rollouts` (the G responses to a prompt
    are contiguous), but the learner does not rely on the order.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    advantages: torch.Tensor  # [N] float, one per response
    truncated: torch.Tensor | None = None  # [N] bool, response hit the length cap; None: none did
    old_logprobs: list[torch.Tensor] | None = None  # per response [len_i]; None: the learner computes them
    zero_std_groups: torch.Tensor | None = None  # [G] bool from group_advantages, for metrics
    num_skipped: int = 0  # responses dropped for a non-finite reward
    sampler_logprobs: list[torch.Tensor] | None = None  # per response [len_i], as sampled (mismatch correction)

    def __len__(self) -> int:
        return len(self.response_ids)

    @classmethod
    def from_rollouts(
        cls,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        rewards: torch.Tensor | list[float],
        group_size: int,
        truncated: torch.Tensor | list[bool] | None = None,
        old_logprobs: list[torch.Tensor] | None = None,
        scale_by_std: bool = True,
        on_invalid: str = "error",
        sampler_logprobs: list[torch.Tensor] | list[list[float]] | None = None,
    ) -> "GRPOSamples":
        """Group-relative advantages from rewards; `prompt_ids` holds one entry per response.

        With `on_invalid="skip"` groups holding a non-finite reward are dropped whole.
        """
        rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
        if not (len(prompt_ids) == len(response_ids) == rewards.numel()):
            raise ValueError(
                f"prompt_ids ({len(prompt_ids)}), response_ids ({len(response_ids)}) and rewards "
                f"({rewards.numel()}) must have one entry per response"
            )
        truncated_t = torch.zeros(rewards.numel(), dtype=torch.bool) if truncated is None else torch.as_tensor(
            truncated, dtype=torch.bool
        )
        keep, num_skipped = check_rewards(rewards, group_size, on_invalid)
        kept = keep.nonzero().squeeze(1).tolist()
        if not kept:
            return cls([], [], torch.zeros(0), torch.zeros(0, dtype=torch.bool), None, None, num_skipped)
        advantages, zero_std = group_advantages(rewards[keep], group_size, scale_by_std)
        return cls(
            prompt_ids=[list(prompt_ids[i]) for i in kept],
            response_ids=[list(response_ids[i]) for i in kept],
            advantages=advantages,
            truncated=truncated_t[keep],
            old_logprobs=None if old_logprobs is None else [torch.as_tensor(old_logprobs[i]) for i in kept],
            zero_std_groups=zero_std,
            num_skipped=num_skipped,
            sampler_logprobs=None if sampler_logprobs is None else [
                torch.as_tensor(sampler_logprobs[i], dtype=torch.float32) for i in kept],
        )

    def validate(self, max_response_len: int, max_seq_len: int, vocab_size: int) -> None:
        """Raise `ValueError` naming the first bad sample."""
        n = len(self.response_ids)
        if n == 0:
            raise ValueError("empty batch: GRPOSamples holds no responses")
        if len(self.prompt_ids) != n:
            raise ValueError(f"prompt_ids has {len(self.prompt_ids)} entries for {n} responses")
        if self.advantages.shape != (n,):
            raise ValueError(f"advantages must be [N={n}], got {tuple(self.advantages.shape)}")
        if not torch.isfinite(self.advantages).all():
            bad = int((~torch.isfinite(self.advantages)).nonzero()[0])
            raise ValueError(f"sample {bad}: advantage is {self.advantages[bad].item()}; advantages must be finite")
        if self.truncated is not None and self.truncated.shape != (n,):
            raise ValueError(f"truncated must be [N={n}], got {tuple(self.truncated.shape)}")
        for name in ("old_logprobs", "sampler_logprobs"):
            per_response = getattr(self, name)
            if per_response is not None and len(per_response) != n:
                raise ValueError(f"{name} has {len(per_response)} entries for {n} responses")
        for i, (prompt, response) in enumerate(zip(self.prompt_ids, self.response_ids)):
            if not prompt:
                raise ValueError(f"sample {i}: empty prompt")
            if not response:
                raise ValueError(f"sample {i}: empty response")
            if len(response) > max_response_len:
                raise ValueError(
                    f"sample {i}: response has {len(response)} tokens, more than max_response_len={max_response_len}"
                )
            if len(prompt) + len(response) > max_seq_len:
                raise ValueError(
                    f"sample {i}: prompt + response has {len(prompt) + len(response)} tokens, "
                    f"more than max_seq_len={max_seq_len}"
                )
            if min(min(prompt), min(response)) < 0 or max(max(prompt), max(response)) >= vocab_size:
                raise ValueError(f"sample {i}: token ids outside the vocabulary [0, {vocab_size})")
            for name in ("old_logprobs", "sampler_logprobs"):
                per_response = getattr(self, name)
                if per_response is not None and per_response[i].shape != (len(response),):
                    raise ValueError(
                        f"sample {i}: {name} has shape {tuple(per_response[i].shape)}, expected ({len(response)},)"
                    )

    def truncated_flags(self) -> torch.Tensor:
        if self.truncated is None:
            return torch.zeros(len(self), dtype=torch.bool)
        return self.truncated.bool()

    def sequence_lengths(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]


@dataclass
class MicroBatch:
    """Right-padded tensors of some samples; [B, R] tensors are aligned with the responses."""

    indices: torch.Tensor  # [B] positions in the GRPOSamples
    input_ids: torch.Tensor  # [B, T] prompt + response + padding
    prompt_lens: torch.Tensor  # [B]
    response_lens: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B]
    truncated: torch.Tensor  # [B] bool
    old_logprobs: torch.Tensor | None = None  # [B, R]
    ref_logprobs: torch.Tensor | None = None  # [B, R]
    sampler_logprobs: torch.Tensor | None = None  # [B, R]

    @property
    def response_mask(self) -> torch.Tensor:
        width = max(int(self.response_lens.max()), 1)
        return torch.arange(width, device=self.response_lens.device)[None] < self.response_lens[:, None]

    @property
    def num_padded_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return MicroBatch(**{k: None if v is None else v.to(device) for k, v in moved.items()})


def pad_response_values(values: list[torch.Tensor], width: int) -> torch.Tensor:
    """Stack per-response 1-D tensors into [B, width] float32, zero-padded."""
    out = torch.zeros(len(values), width, dtype=torch.float32)
    for row, v in enumerate(values):
        out[row, : v.numel()] = v.float()
    return out


def pad_samples(
    samples: GRPOSamples,
    indices: list[int],
    old_logprobs: list[torch.Tensor] | None = None,
    ref_logprobs: list[torch.Tensor] | None = None,
) -> MicroBatch:
    """Right-pad the chosen samples. Pads are token 0: causal attention keeps them invisible to
    real tokens and the masks drop their outputs, so their value never matters."""
    if not indices:
        raise ValueError("pad_samples needs at least one index")
    prompts = [samples.prompt_ids[i] for i in indices]
    responses = [samples.response_ids[i] for i in indices]
    prompt_lens = torch.tensor([len(p) for p in prompts])
    response_lens = torch.tensor([len(r) for r in responses])
    input_ids = torch.zeros(len(indices), int((prompt_lens + response_lens).max()), dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[row, : len(p) + len(r)] = torch.tensor(p + r)
    width = int(response_lens.max())

    def gathered(per_sample: list[torch.Tensor] | None) -> torch.Tensor | None:
        return None if per_sample is None else pad_response_values([per_sample[i] for i in indices], width)

    return MicroBatch(
        indices=torch.tensor(indices),
        input_ids=input_ids,
        prompt_lens=prompt_lens,
        response_lens=response_lens,
        advantages=samples.advantages[indices].float(),
        truncated=samples.truncated_flags()[indices],
        old_logprobs=gathered(old_logprobs),
        ref_logprobs=gathered(ref_logprobs),
        sampler_logprobs=gathered(samples.sampler_logprobs),
    )


def micro_batch_indices(lengths: list[int], indices: list[int], token_budget: int) -> list[list[int]]:
    """Split `indices` (into `lengths`) into groups whose padded size B * max_len fits the budget.

    Longest first, filled greedily: neighbours in length share a micro-batch, so padding is
    small. A sequence longer than the budget forms a micro-batch of its own.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    ordered = sorted(indices, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in ordered:
        # Sorted descending, so a group's first member is its longest.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def mini_batch_indices(num_samples: int, mini_batch_size: int | None, generator: torch.Generator) -> list[list[int]]:
    """A shuffled partition of range(num_samples) into optimizer-step sized chunks."""
    order = torch.randperm(num_samples, generator=generator, device=generator.device).tolist()
    size = num_samples if mini_batch_size is None else mini_batch_size
    return [order[start : start + size] for start in range(0, num_samples, size)]


def loss_normalizer(batches: list[MicroBatch], loss_cfg: PolicyLossConfig) -> int:
    """The mini-batch-wide denominator of the aggregation (valid tokens for token-mean,
    non-empty sequences for the seq-mean modes), summed over its micro-batches."""
    total = 0
    for mb in batches:
        valid = valid_token_mask(mb.response_mask, mb.truncated, loss_cfg.mask_truncated)
        total += int(aggregation_denominator(valid, loss_cfg.aggregation))
    return total

