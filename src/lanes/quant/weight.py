"""Weights a model part multiplies by: `matmul(x)` for x [T, in] -> [T, out] in x's dtype.

`QuantWeight` keeps a GGUF block format's bytes at their size ([out, row bytes] uint8; Q8_0, Q4_0 and Q4_1
rows reordered for the integer kernels, int8_layout.py) and runs the C++ kernels over them; `DenseWeight` is a plain tensor (F32/F16/BF16 files, Hugging Face folders, or
a type without a kernel, dequantized); `StackedWeight` is fused rows of weights of different types.
"""

from __future__ import annotations

import functools
import sys
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

from .formats import BlockFormat
from .int8_layout import from_lanes, to_lanes
from .native import available, cpu_vendor, flavor, kernels

INTEGER = {"Q8_0", "Q4_0", "Q4_1"}  # multiplied in integers, activations quantized to 8 bits a group of 32
PANEL_ROWS = 32  # from this many rows of x on, panels decoded to fp32 and BLAS win (bench/quant_kernels.py)
PANEL = 256  # weight rows decoded a panel at most: 256 x 1536 fp32 is 1.5 MiB, inside one core's 2 MiB L2
# fp32 products of up to this many rows of x run our kernel, which reads the weight once for all; the rest
# torch's F.linear (MKL). Measured against it (bench/RESULTS.md): on Intel's AVX-512 ours wins to 16 rows, on
# AVX2 (a Zen 3) to 48 and, summed over a model, at 64; on AMD's AVX-512 (a Zen 4) MKL runs no AVX-512 code,
# ours wins to 512 rows and is even at 1024-2048, so every product there is ours (a row's bits its own).
FEW_ROWS = 16
FEW_ROWS_AVX2 = 64
EVERY_ROW = sys.maxsize


def few_rows_for(build: str, vendor: str) -> int:
    """The most rows of x an fp32 product gives our kernel, for a kernel build (`native.flavor`) and CPU maker."""
    if build == "avx2":
        return FEW_ROWS_AVX2
    return EVERY_ROW if vendor == "AuthenticAMD" else FEW_ROWS


@functools.cache
def few_rows() -> int:
    """The most rows of x an fp32 product gives our kernel on this CPU."""
    return few_rows_for(flavor(), cpu_vendor())


def spread_fetch_for(build: str, vendor: str) -> bool:
    """Whether `mm_f32` fetches the next block over all of a block's x tiles (measured faster on a Zen 4's
    AVX-512, at 1 row too) or the block 2 ahead during the first tile (measured faster on a Sapphire Rapids)."""
    return build != "avx2" and vendor == "AuthenticAMD"


@functools.cache
def spread_fetch() -> bool:
    return spread_fetch_for(flavor(), cpu_vendor())


class Weight(Protocol):
    """What a part asks of a weight of shape [out, in]."""

    shape: tuple[int, int]

    @property
    def type_name(self) -> str: ...

    @property
    def resident_bytes(self) -> int: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...

    def take(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def rows(self, index: torch.Tensor) -> "Weight": ...


class QuantWeight:
    """An [out, in] weight in a GGUF block format, built from the file's bytes [out, row bytes] uint8 and
    kept at their size: `packed` holds them in the kernels' layout (int8_layout.py; the K-quants as they are).

    Q8_0, Q4_0 and Q4_1 multiply in integers, each group of 32 activations quantized to 8 bits as llama.cpp
    does for these types (docs/DECISIONS.md, "Integer products"); the K-quants multiply fp32 activations by
    their values decoded in registers."""

    def __init__(self, raw: torch.Tensor, fmt: BlockFormat, shape: tuple[int, int], *, packed: bool = False) -> None:
        out_features, in_features = shape
        if raw.dtype != torch.uint8 or tuple(raw.shape) != (out_features, fmt.row_bytes(in_features)):
            raise ValueError(f"{fmt.name} [{out_features}, {in_features}] needs uint8 "
                             f"[{out_features}, {fmt.row_bytes(in_features)}], not {raw.dtype} {list(raw.shape)}")
        self.integer = fmt.name in INTEGER
        self.packed = raw.contiguous() if packed or not self.integer else to_lanes(raw, fmt)  # [out, row bytes] uint8
        self.format = fmt
        self.shape = (out_features, in_features)
        self._ops = kernels()

    def file_bytes(self) -> torch.Tensor:
        """[out, row bytes] uint8 in the file's layout (for checks and for writing GGUF files)."""
        return from_lanes(self.packed, self.format) if self.integer else self.packed

    @property
    def type_name(self) -> str:
        return self.format.name

    @property
    def resident_bytes(self) -> int:
        return self.packed.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (any float dtype) @ W.T -> [T, out] in x's dtype, accumulated in fp32."""
        x32 = x if x.dtype == torch.float32 else x.float()
        n, k = self.shape
        if self.integer:
            out = self._ops.mm_int8(x32, self.packed, self.format.kind, n, k)
        elif x32.shape[0] < PANEL_ROWS:
            out = self._ops.mm_tiles(x32, self.packed, self.format.kind, n, k)
        else:
            out = self._ops.mm_panels(x32, self.packed, self.format.kind, n, k, PANEL)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def take(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [R] int64 dequantized: [R, in] in `dtype` (an embedding lookup)."""
        take = self._ops.take_int8 if self.integer else self._ops.take_rows
        rows = take(self.packed, ids.to(torch.int64), self.format.kind, *self.shape)
        return rows if dtype == torch.float32 else rows.to(dtype)

    def rows(self, index: torch.Tensor) -> "QuantWeight":
        """The weight of output rows `index` [R] (a row is whole blocks, so rows move as bytes)."""
        rows = self.packed.index_select(0, index.to(torch.int64))
        return QuantWeight(rows, self.format, (len(index), self.shape[1]), packed=True)

    def dequantize(self) -> torch.Tensor:
        """[out, in] fp32, for checks (never on a load path)."""
        return self.take(torch.arange(self.shape[0]), torch.float32)


class DenseWeight:
    """A plain [out, in] tensor; `type_name` says what it was read from when that was not this dtype."""

    def __init__(self, tensor: torch.Tensor, source: str | None = None) -> None:
        self.tensor = tensor
        self.shape = (int(tensor.shape[0]), int(tensor.shape[1]))
        self.source = source

    @property
    def type_name(self) -> str:
        dtype = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}.get(self.tensor.dtype, str(self.tensor.dtype))
        return dtype if self.source in (None, dtype) else f"{self.source} (held as {dtype})"

    @property
    def resident_bytes(self) -> int:
        return self.tensor.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return dense_product(x, self.tensor if x.dtype == self.tensor.dtype else self.tensor.to(x.dtype))

    def take(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids, self.tensor).to(dtype)

    def rows(self, index: torch.Tensor) -> "DenseWeight":
        return DenseWeight(self.tensor.index_select(0, index.to(torch.int64)), self.source)


def dense_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w.T (+ bias) for a full-precision w: up to `few_rows()` fp32 rows on the CPU (a decode pass's
    few; on AMD's AVX-512 any number) by our kernel, which reads w once for all of them and gives each row the
    same bits at any row count; the rest by torch."""
    if (x.dtype == w.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= few_rows() and w.device.type == "cpu"
            and w.is_contiguous() and available()):
        out = kernels().mm_f32(x, w, spread_fetch())
        return out if bias is None else out + bias
    return F.linear(x, w, bias)


class StackedWeight:
    """Weights of one input width whose outputs are concatenated (q/k/v or gate/up of different types)."""

    def __init__(self, parts: Sequence[Weight]) -> None:
        self.parts = list(parts)
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    @property
    def type_name(self) -> str:
        return "+".join(p.type_name for p in self.parts)

    @property
    def resident_bytes(self) -> int:
        return sum(p.resident_bytes for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in self.parts], dim=-1)

    def take(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise TypeError("a stacked weight has no rows to take (its outputs are concatenated)")

    def rows(self, index: torch.Tensor) -> Weight:
        raise TypeError("take rows of the parts before stacking them")


def pad_rows(weight: Weight, rows: int) -> Weight:
    """`weight` with zero rows after its own up to `rows` (a vocabulary slice padded to the per-rank size;
    zero bytes are zero values in every block format)."""
    missing = rows - weight.shape[0]
    if missing <= 0:
        return weight
    if isinstance(weight, QuantWeight):  # zero bytes in the file's layout, which are zero values
        zeros = torch.zeros(missing, weight.packed.shape[1], dtype=torch.uint8, device=weight.packed.device)
        return stack_rows([weight, QuantWeight(zeros, weight.format, (missing, weight.shape[1]))])
    if isinstance(weight, DenseWeight):
        return stack_rows([weight, DenseWeight(weight.tensor.new_zeros(missing, weight.shape[1]), weight.source)])
    raise TypeError(f"cannot pad a {type(weight).__name__}")


def stack_rows(weights: Sequence[Weight]) -> Weight:
    """One weight whose output rows are `weights`' rows in order: one QuantWeight when they share a format
    (bytes concatenated), one DenseWeight when all are dense of one dtype, else a StackedWeight."""
    if len({w.shape[1] for w in weights}) != 1:
        raise ValueError(f"stacked weights need one input width, not {[w.shape for w in weights]}")
    if len(weights) == 1:
        return weights[0]
    if all(isinstance(w, QuantWeight) for w in weights) and len({w.format for w in weights}) == 1:
        packed = torch.cat([w.packed for w in weights])
        return QuantWeight(packed, weights[0].format, (packed.shape[0], weights[0].shape[1]), packed=True)
    joined = getattr(type(weights[0]), "concatenated", None)  # another device's format weights join themselves
    if joined is not None and all(type(w) is type(weights[0]) for w in weights):
        stacked = joined(weights)
        if stacked is not None:
            return stacked
    if all(isinstance(w, DenseWeight) for w in weights) and len({w.tensor.dtype for w in weights}) == 1:
        return DenseWeight(torch.cat([w.tensor for w in weights]), weights[0].source)
    runs: list[list[Weight]] = []  # neighbours of one format fused: q and k of Q4_1 beside a Q8_0 v
    for w in weights:
        if runs and _fusable(runs[-1][-1], w):
            runs[-1].append(w)
        else:
            runs.append([w])
    return StackedWeight([stack_rows(run) for run in runs])


def _fusable(a: Weight, b: Weight) -> bool:
    if isinstance(a, QuantWeight) and isinstance(b, QuantWeight):
        return a.format == b.format
    return isinstance(a, DenseWeight) and isinstance(b, DenseWeight) and a.tensor.dtype == b.tensor.dtype
