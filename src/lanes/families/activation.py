"""silu(gate) * up from a fused gate_up product, the gated MLP's activation (dense layers and experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.native import available


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns, then up) -> [T, I]. On the CPU in fp32 our kernel (lanes/quant/
    cpu_activation.cpp), which computes a row alike in any pass; elsewhere torch's two ops."""
    if gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 and available():
        return torch.ops.lanes_quant.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
