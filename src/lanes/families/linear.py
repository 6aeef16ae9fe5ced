"""Weights as the products parts ask of them: a `Linear`, a `RowParallel` one summed across ranks, and
`ExpertLinear`, every expert's matrix stacked and multiplied by its own rows.

A part holds these and asks them for x W^T; it never reads their tensors, so a weight kept in another
form (quantized blocks) can stand in for a full-precision one with the same calls. The one-row GEMVs of
the graphed path (`gemv`, `norm_gemv`, `norm_gate_up_silu`) are products too: a weight that has no such
kernel says so in `one_row_ready`, and the graphed step then runs the general product.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..gpu.collective import Collective


class Linear:
    """y = x W^T + b, full precision: W [out, in] (this rank's shard) and b [out] or None, on the device."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] in x's dtype."""
        return F.linear(x, self.weight, self.bias)

    def one_row_ready(self) -> bool:
        """Whether the one-row GEMVs can read this weight (they read it by rows)."""
        return self.weight.is_contiguous()

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """`self(x)` for one row x [1, in], on the CUDA cores (`gpu.gemv`)."""
        from ..gpu import gemv

        return gemv.gemv(x, self.weight, self.bias)

    def norm_gemv(self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(rms_norm(x + residual) * norm), x + residual) for one row, the norm fused into the load of x."""
        from ..gpu import gemv

        return gemv.norm_gemv(x, residual, norm, eps, self.weight, self.bias)

    def norm_gate_up_silu(self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """For a fused gate/up weight [2I, in]: (silu(gate) * up of the normed row, x + residual), one row."""
        from ..gpu import gemv

        return gemv.norm_gate_up_silu(x, residual, norm, eps, self.weight, self.bias)


class RowParallel:
    """A row-parallel linear: each rank multiplies its slice of the input columns, the partial products are
    summed across ranks, and the bias is added once after the sum (inside the product on one rank)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Collective) -> None:
        alone = comm.world == 1
        self.linear = Linear(weight, bias if alone else None)
        self.bias = None if alone else bias
        self.comm = comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in / world] -> [T, out], the same on every rank."""
        out = self.comm.all_reduce(self.linear(x))
        return out if self.bias is None else out + self.bias

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the sum, without the bias: a caller that adds shares first sums them once."""
        return F.linear(x, self.linear.weight)


class ExpertLinear:
    """Every expert's linear, stacked: W [experts, out, in] on the device (this rank's shard of each)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    def grouped(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """x: [R, in], its rows sorted by expert, `counts[e]` rows for expert e -> [R, out], each row through
        its own expert's matrix. One product an expert with rows; experts without rows cost nothing."""
        out = x.new_empty(x.shape[0], self.out_features)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                torch.mm(x[start : start + count], self.weight[expert].t(), out=out[start : start + count])
                start += count
        return out
