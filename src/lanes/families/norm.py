"""RMSNorm as the Hugging Face decoders compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.native import available


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H], weight: [H]. Normalised in float32 and cast back before the weight, as the reference does.
    On the CPU in fp32 our kernel (lanes/quant/cpu_norm.cpp: one op, a row alike in any pass)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        if available():
            return torch.ops.lanes_quant.rms_norm(x, weight, eps)
        return F.rms_norm(x, weight.shape, weight, eps)  # the same in one call (eight ops inside)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
