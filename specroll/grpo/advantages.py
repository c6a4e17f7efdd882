"""Group-relative advantages: each response is scored against the other responses to its prompt.

Rewards arrive as ``num_groups * group_size`` samples, group-major (the ``group_size`` responses
to one prompt are contiguous), either flat ``[N]`` or shaped ``[num_groups, group_size]``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

OnInvalid = Literal["error", "skip"]
ON_INVALID_MODES: tuple[str, ...] = ("error", "skip")


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Return ``rewards`` as ``[num_groups, group_size]`` after checking the layout."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2, got {group_size}: a lone response has no group "
            "baseline, so its advantage is undefined"
        )
    if rewards.dim() == 2:
        if rewards.shape[1] != group_size:
            raise ValueError(
                f"rewards of shape {tuple(rewards.shape)} must be [num_groups, group_size="
                f"{group_size}]"
            )
    elif rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D or 2-D, got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) is not divisible by group_size ({group_size})"
        )
    return rewards.reshape(-1, group_size)


def check_rewards(
    rewards: Tensor, group_size: int, on_invalid: OnInvalid = "error"
) -> tuple[Tensor, int]:
    """Find NaN/inf rewards before they poison a whole batch of advantages.

    Args:
        rewards: ``[N]`` or ``[num_groups, group_size]`` rewards.
        group_size: responses per prompt.
        on_invalid: ``"error"`` raises ``ValueError`` naming the flat index of the first
            non-finite reward; ``"skip"`` drops every group holding one, because the group
            baseline of such a group is meaningless.

    Returns:
        ``(keep, num_skipped)``: ``keep`` is a ``[N]`` bool mask of samples to keep and
        ``num_skipped`` the number of samples dropped (a multiple of ``group_size``).
    """
    if on_invalid not in ON_INVALID_MODES:
        raise ValueError(f"on_invalid must be one of {ON_INVALID_MODES}, got {on_invalid!r}")
    grouped = _grouped(rewards, group_size)
    finite = torch.isfinite(grouped) if grouped.is_floating_point() else torch.ones_like(
        grouped, dtype=torch.bool
    )
    if on_invalid == "error":
        bad = (~finite).reshape(-1).nonzero()
        if bad.numel() > 0:
            index = int(bad[0])
            raise ValueError(
                f"reward at index {index} is {grouped.reshape(-1)[index].item()}; "
                "rewards must be finite"
            )
        return torch.ones(grouped.numel(), dtype=torch.bool, device=grouped.device), 0
    keep = finite.all(dim=1, keepdim=True).expand_as(finite).reshape(-1)
    return keep, int((~keep).sum())


def group_advantages(
    rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """GRPO advantages ``A_i = (r_i - mean(r)) / (std(r) + eps)`` within each group.

    ``std`` is the sample standard deviation (``torch.std`` default, ``unbiased=True``), as in
    TRL and verl, so a given config produces the same advantages as those trainers.

    Args:
        rewards: ``[N]`` or ``[num_groups, group_size]`` finite rewards (see ``check_rewards``).
        group_size: responses per prompt, at least 2.
        scale_by_std: ``False`` gives Dr.GRPO's ``A_i = r_i - mean(r)``, which avoids
            up-weighting prompts whose rewards barely vary.
        eps: keeps the division finite for nearly-equal rewards.

    Returns:
        ``(advantages, zero_std)``: ``advantages`` is ``[N]`` (one value per response, applied
        to each of its tokens); ``zero_std`` is a ``[num_groups]`` bool mask of groups whose
        rewards are all equal. Those groups get exactly zero advantage (no learning signal),
        and the caller logs their share as ``train/frac_zero_std_groups``.
    """
    check_rewards(rewards, group_size, on_invalid="error")
    grouped = _grouped(rewards, group_size)
    if not grouped.is_floating_point():
        grouped = grouped.to(torch.get_default_dtype())
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    zero_std = grouped.amax(dim=1) == grouped.amin(dim=1)
    # Rounding in the mean leaves ~1e-8 residues in equal groups, which the std division
    # would blow up to a spurious signal; those groups are forced to exactly zero.
    advantages = torch.where(zero_std[:, None], torch.zeros_like(centered), centered)
    return advantages.reshape(-1), zero_std
