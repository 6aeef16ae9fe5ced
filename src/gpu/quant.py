"""`CudaQuantWeight`: a GGUF-format weight on the GPU, kept in its bytes and multiplied by quant_kernels.

The `Weight` of lanes.quant.weight (matmul, take, rows, type_name, resident_bytes) for Q8_0, Q4_K and Q6_K:
the file's bytes copied to the device once (Q8_0 reordered planar by lanes.quant.layout, the same size).
Decode products (up to GEMV_ROWS rows) take the CUDA-core GEMV; larger ones the tensor-core kernel that
decodes a tile in registers (`PREFILL = "fused"`) or the weight dequantized to x's dtype then cuBLAS
(`"dequantize"`); bench/gpu_quant.py measures both.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lanes.quant.formats import BlockFormat
from lanes.quant.layout import to_file, to_kernel

from . import quant_kernels as kernels

KINDS = frozenset((kernels.Q8_0, kernels.Q4_K, kernels.Q6_K))  # the formats these kernels read
GEMV_ROWS = 8  # up to this many rows of x the CUDA-core GEMV (weights read once, fp32 throughout)
PREFILL = "fused"  # past GEMV_ROWS: "fused" (tiles decoded in registers) or "dequantize" (then cuBLAS)


def gemv_config(m: int, n: int, k: int, kind: int) -> dict:
    """Tiles for the GEMV: one or two weight rows a program, several super-blocks a step (1-2 KB of weight
    bytes in flight a program; Q4_K's decode takes the most registers, so it takes one row), K split only
    when rows are too few to fill the GPU; two rows and one super-block past 4 rows of x. First guesses
    (registers from bench/quant_compile.py), for bench/gpu_quant.py's sweep to confirm."""
    if m > 4:
        block_n, sb = 2, 1
    else:
        block_n, sb = (1, 8) if kind == kernels.Q4_K else (2, 4)
    programs = -(-n // block_n)
    return dict(block_n=block_n, sb=sb, split_k=max(1, min(8, (4 * 132) // programs)))


def mm_config(m: int, n: int, k: int) -> dict:
    """Tiles for the tensor-core kernel, 8 warps: 16 or 32 rows x 64 for few rows, else 64 x 64 (compiled for
    sm_90, bench/quant_compile.py: of the tiles tried, those that spill no registers in all three formats)."""
    return dict(block_m=16 if m <= 16 else 32 if m <= 32 else 64, block_n=64, num_warps=8, num_stages=3)


class CudaQuantWeight:
    """An [out, in] weight in a GGUF block format with a CUDA kernel (`KINDS`), from the file's bytes
    [out, row bytes] uint8 on the device (`packed=True`: already in the kernels' layout)."""

    def __init__(self, raw: torch.Tensor, fmt: BlockFormat, shape: tuple[int, int], *, packed: bool = False) -> None:
        out_features, in_features = shape
        if fmt.kind not in KINDS:
            raise ValueError(f"{fmt.name} has no CUDA kernel (these do: Q8_0, Q4_K, Q6_K)")
        if raw.dtype != torch.uint8 or tuple(raw.shape) != (out_features, fmt.row_bytes(in_features)):
            raise ValueError(f"{fmt.name} [{out_features}, {in_features}] needs uint8 "
                             f"[{out_features}, {fmt.row_bytes(in_features)}], not {raw.dtype} {list(raw.shape)}")
        self.packed = raw.contiguous() if packed else to_kernel(raw, fmt)
        self.format = fmt
        self.shape = (out_features, in_features)

    @property
    def type_name(self) -> str:
        return self.format.name

    @property
    def resident_bytes(self) -> int:
        return self.packed.nbytes

    def file_bytes(self) -> torch.Tensor:
        """[out, row bytes] uint8 in the file's layout (for checks)."""
        return to_file(self.packed, self.format)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] (bf16, f16 or fp32, on the weight's device) @ W.T -> [T, out] in x's dtype."""
        n, k = self.shape
        if x.shape[-1] != k:
            raise ValueError(f"x has {x.shape[-1]} columns, the weight {k}")
        x = x.contiguous()
        m = x.shape[0]
        if m == 0:
            return x.new_empty(0, n)
        if m <= GEMV_ROWS:
            return kernels.gemv(x, self.packed, self.format.kind, n, k, **gemv_config(m, n, k, self.format.kind))
        if PREFILL == "dequantize":
            return x @ self.dequantize(x.dtype).T
        return kernels.mm(x, self.packed, self.format.kind, n, k, **mm_config(m, n, k))

    def take(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [R] dequantized: [R, in] in `dtype` (an embedding lookup)."""
        return self.rows(ids).dequantize(dtype)

    def rows(self, index: torch.Tensor) -> "CudaQuantWeight":
        """The weight of output rows `index` [R] (a row is whole blocks, so rows move as bytes)."""
        rows = self.packed.index_select(0, index.to(device=self.packed.device, dtype=torch.int64))
        return CudaQuantWeight(rows, self.format, (len(index), self.shape[1]), packed=True)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] in `dtype`, decoded exactly as the gguf package decodes (then rounded to `dtype`)."""
        return kernels.dequantize(self.packed, self.format.kind, *self.shape, dtype)

    @classmethod
    def concatenated(cls, weights: Sequence["CudaQuantWeight"]) -> "CudaQuantWeight | None":
        """One weight of `weights`' rows in order when they share a format (bytes concatenated), else None."""
        if len({w.format for w in weights}) != 1:
            return None
        packed = torch.cat([w.packed for w in weights])
        return cls(packed, weights[0].format, (packed.shape[0], weights[0].shape[1]), packed=True)
