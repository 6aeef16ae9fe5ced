"""RMSNorm as the Hugging Face decoders compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H], weight: [H]. Normalised in float32 and cast back before the weight, as the reference does."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and not x.is_cuda:
        return F.rms_norm(x, weight.shape, weight, eps)  # the same in one op (five eager ops a norm on the CPU path)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
