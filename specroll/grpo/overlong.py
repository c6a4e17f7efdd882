"""DAPO's soft overlong punishment: a reward penalty on responses in the last stretch before the cap.

With ``L_max`` the length cap and ``L_cache`` the buffer (DAPO eq. 13, TRL
``get_soft_overlong_punishment``):

    R_length(y) = 0                                   if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                   if |y| > L_max

so the penalty grows linearly to -1 at the cap instead of a truncated response alone
carrying an arbitrary reward. It is added to the task reward before group advantages.
"""

from __future__ import annotations

import torch
from torch import Tensor


def soft_overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int) -> Tensor:
    """``R_length`` per response, float32 ``[N]``, from response lengths ``[N]``."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len ({buffer_len}) <= max_len ({max_len})")
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    start = max_len - buffer_len
    penalty = ((start - lengths) / buffer_len).clamp(min=-1.0, max=0.0)
    return torch.where(lengths > max_len, torch.full_like(penalty, -1.0), penalty)
