"""Weights as the products parts ask of them: a `Linear`, a `RowParallel` one summed across ranks, and
`ExpertLinear`, every expert's matrix stacked and multiplied by its own rows (`Groups`).

A part holds these and asks them for x W^T; it never reads their tensors, so a weight kept in another
form (quantized blocks) can stand in for a full-precision one with the same calls. The one-row GEMVs of
the graphed path (`gemv`, `norm_gemv`, `norm_gate_up_silu`) are products too: a weight that has no such
kernel says so in `one_row_ready`, and the graphed step then runs the general product.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..gpu.collective import Collective
from ..quant import DenseWeight, Weight
from ..quant.weight import dense_product


class Linear:
    """y = x W^T + b: W [out, in] (this rank's shard) a full-precision tensor, or a `lanes.quant` Weight
    (kept quantized; a DenseWeight is unwrapped to its tensor), and b [out] or None, on the device."""

    def __init__(self, weight: torch.Tensor | Weight, bias: torch.Tensor | None = None) -> None:
        self.read = weight  # as read (a DenseWeight says what it was read from)
        self.weight = weight.tensor if isinstance(weight, DenseWeight) else weight
        self.bias = bias
        self.dense = isinstance(self.weight, torch.Tensor)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> [T, out] in x's dtype."""
        if self.dense:
            return dense_product(x, self.weight, self.bias)
        out = self.weight.matmul(x)
        return out if self.bias is None else out + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias."""
        return dense_product(x, self.weight) if self.dense else self.weight.matmul(x)

    def one_row_ready(self) -> bool:
        """Whether the one-row GEMVs can read this weight (they read a tensor by rows)."""
        return self.dense and self.weight.is_contiguous()

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

    def __init__(self, weight: torch.Tensor | Weight, bias: torch.Tensor | None, comm: Collective) -> None:
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
        return self.linear.product(x)


class Groups:
    """Rows sorted by expert: `ends` [experts] int32 on the device, where each expert's rows end (the next
    one's begin). `counts()` reads them on the host, once, for the products that loop over experts."""

    def __init__(self, ends: torch.Tensor) -> None:
        self.ends = ends
        self._counts: list[int] | None = None

    @classmethod
    def of_sorted(cls, picks: torch.Tensor, experts: int) -> "Groups":
        """From the expert of each row, sorted [R] int64: a search, not a count (CUDA's bincount reads a
        maximum on the host, which a captured graph cannot hold)."""
        bounds = torch.arange(experts, device=picks.device, dtype=picks.dtype)
        return cls(torch.searchsorted(picks, bounds, right=True).to(torch.int32))

    def counts(self) -> list[int]:
        if self._counts is None:
            self._counts = torch.diff(self.ends, prepend=self.ends.new_zeros(1)).tolist()  # a host read
        return self._counts


# torch's grouped product: F.grouped_mm (2.10 on) or the operator behind it (2.8 on); 10-30% faster than a
# loop on 2 CPU cores, and on CUDA one kernel with the row counts read on the device
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def fused_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the grouped product is one kernel here with no host read: the CPU (any float dtype), or CUDA
    in bf16 on Hopper or Blackwell (CUTLASS's grouped GEMM; other GPUs take a fallback that loops)."""
    if _GROUPED_MM is None:
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype == torch.bfloat16 and _major(device.index) in (9, 10)


@functools.cache
def _major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


class ExpertLinear:
    """Every expert's linear, stacked: W [experts, out, in] on the device (this rank's shard of each)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    def grouped(self, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        """x: [R, in], its rows sorted by expert as `groups` says -> [R, out], each row through its own
        expert's matrix. Where `fused_on` says so, one grouped product (no host read); elsewhere one product
        an expert with rows, their counts read on the host."""
        if self.fused(x):
            return _GROUPED_MM(x, self.weight.transpose(-2, -1), offs=groups.ends)
        out = x.new_empty(x.shape[0], self.out_features)
        start = 0
        for expert, count in enumerate(groups.counts()):
            if count:
                torch.mm(x[start : start + count], self.weight[expert].t(), out=out[start : start + count])
                start += count
        return out

    def fused(self, x: torch.Tensor) -> bool:
        """Whether `grouped(x, ...)` is the one grouped product."""
        return x.dtype == self.weight.dtype and self.graph_safe() and self._aligned(x)

    def graph_safe(self) -> bool:
        """Whether products with this weight (in its dtype) read nothing on the host, so a graph may hold them."""
        w = self.weight
        return fused_on(w.device, w.dtype) and w.is_contiguous() and (w.shape[2] * w.element_size()) % 16 == 0

    def _aligned(self, x: torch.Tensor) -> bool:
        """grouped_mm needs rows of x and of the output on 16-byte strides."""
        size = x.element_size()
        return (x.shape[1] * size) % 16 == 0 and (self.out_features * size) % 16 == 0 and x.is_contiguous()
