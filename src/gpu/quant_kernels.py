"""Triton kernels over GGUF block formats on the GPU: Q8_0, Q4_K and Q6_K weights read in their bytes.

Q8_0 rows are in lanes.quant.layout's planar order (a row's int8 quants, then its f16 scales: the file's
bytes reordered, the same size), so quants load as whole vectors; Q4_K (144-byte super-blocks of 256) and
Q6_K (210 bytes) stay as the file has them. Every kernel decodes a tile of weights in registers with the
gguf package's arithmetic (fp32: d * sc * q - dmin * m for Q4_K) and never writes it out, except
`dequantize`, which writes bf16/fp32 rows (embedding lookups, checks).

A tile is one or more *parts*: weights [BLOCK_N, P] whose columns map to value indices of the row (Q8_0:
consecutive values; Q4_K: the low and the high nibbles of a super-block's 128 bytes, values 64c + l and
64c + 32 + l; Q6_K: four parts of 64 positions). Kernels load the x columns that match each part.
- `gemv`: few rows of x (decode), products summed on the CUDA cores, fp32 throughout; `sb` super-blocks
  a step (bytes in flight), K optionally split over programs (fp32 partials summed after).
- `mm`: many rows (prefill), 64 values a step decoded, cast to x's dtype and multiplied on the tensor
  cores (a small live tile: no register spills at 8 warps, bench/quant_compile.py).
Imported only where Triton is (tests run them on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
Q8_0, Q4_K, Q6_K = 8, 12, 14  # ggml's type numbers


@triton.jit
def _f16(ptr, at, mask):
    """An f16 stored little-endian at byte offsets `at` of a uint8 buffer, as fp32 (any alignment)."""
    lo = tl.load(ptr + at, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + at + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q8_0(w_ptr, rows, nmask, row_bytes, K, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Q8_0 planar: values k0..k0+BLOCK_K of each row: ([BLOCK_N, BLOCK_K] fp32, their columns [BLOCK_K])."""
    cols = k0 + tl.arange(0, BLOCK_K)
    base = rows[:, None].to(tl.int64) * row_bytes
    mask = nmask[:, None] & (cols[None, :] < K)
    q = tl.load(w_ptr + base + cols[None, :], mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    d = _f16(w_ptr, base + K + 2 * groups[None, :], nmask[:, None] & (groups[None, :] < K // 32))
    w = tl.reshape(q, (BLOCK_N, BLOCK_K // 32, 32)) * d[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K)), cols


@triton.jit
def _scale_min(ptr, at, j, mask):
    """Q4_K's 6-bit scale and minimum of sub-blocks `j` from the 12 packed bytes at `at` (ggml's get_scale_min_k4)."""
    low = j < 4
    a = tl.load(ptr + at + tl.where(low, j, j + 4), mask=mask, other=0).to(tl.int32)
    b = tl.load(ptr + at + tl.where(low, j + 4, j - 4), mask=mask, other=0).to(tl.int32)
    c = tl.load(ptr + at + tl.where(low, j + 4, j), mask=mask, other=0).to(tl.int32)
    sc = tl.where(low, a & 63, (a & 15) | ((b >> 6) << 4))
    m = tl.where(low, c & 63, (a >> 4) | ((c >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _q4_k(w_ptr, rows, nmask, row_bytes, sb0, NSB, BLOCK_N: tl.constexpr, SB: tl.constexpr):
    """Super-blocks sb0..sb0+SB of each row (those past NSB read as zeros): (low part, its columns, high
    part, its columns), parts [BLOCK_N, SB * 128]: value 64c + l of a super-block is byte 32c + l's low
    nibble, value 64c + 32 + l its high one."""
    sbs = sb0 + tl.arange(0, SB)
    smask = nmask[:, None] & (sbs[None, :] < NSB)  # [BLOCK_N, SB]
    base = rows[:, None].to(tl.int64) * row_bytes + sbs[None, :] * 144
    d = _f16(w_ptr, base, smask)
    dmin = _f16(w_ptr, base + 2, smask)
    chunk = tl.arange(0, 4)[None, None, :]
    sc_lo, m_lo = _scale_min(w_ptr, base[:, :, None] + 4, 2 * chunk, smask[:, :, None])  # [BLOCK_N, SB, 4]
    sc_hi, m_hi = _scale_min(w_ptr, base[:, :, None] + 4, 2 * chunk + 1, smask[:, :, None])
    b = tl.arange(0, 128)
    q = tl.load(w_ptr + base[:, :, None] + 16 + b[None, None, :], mask=smask[:, :, None], other=0)
    q_lo = tl.reshape((q & 15).to(tl.float32), (BLOCK_N, SB, 4, 32))
    q_hi = tl.reshape((q >> 4).to(tl.float32), (BLOCK_N, SB, 4, 32))
    lo = q_lo * (d[:, :, None] * sc_lo)[:, :, :, None] - (dmin[:, :, None] * m_lo)[:, :, :, None]
    hi = q_hi * (d[:, :, None] * sc_hi)[:, :, :, None] - (dmin[:, :, None] * m_hi)[:, :, :, None]
    cols = tl.reshape(sbs[:, None] * 256 + ((b // 32) * 64 + b % 32)[None, :], (SB * 128,))
    return tl.reshape(lo, (BLOCK_N, SB * 128)), cols, tl.reshape(hi, (BLOCK_N, SB * 128)), cols + 32


@triton.jit
def _q4_k_chunk(w_ptr, rows, nmask, row_bytes, sb, c):
    """Chunk `c` (0..3: 32 bytes, 64 values) of super-block `sb`: (low [BLOCK_N, 32], its columns, high, its
    columns); one sub-block's scale each, so no reshape (the tensor-core kernel's small live tile)."""
    base = rows[:, None].to(tl.int64) * row_bytes + sb * 144
    d = _f16(w_ptr, base, nmask[:, None])
    dmin = _f16(w_ptr, base + 2, nmask[:, None])
    sc_lo, m_lo = _scale_min(w_ptr, base + 4, 2 * c, nmask[:, None])
    sc_hi, m_hi = _scale_min(w_ptr, base + 4, 2 * c + 1, nmask[:, None])
    lane = tl.arange(0, 32)
    q = tl.load(w_ptr + base + 16 + 32 * c + lane[None, :], mask=nmask[:, None], other=0)
    lo = (q & 15).to(tl.float32) * (d * sc_lo) - dmin * m_lo
    hi = (q >> 4).to(tl.float32) * (d * sc_hi) - dmin * m_hi
    cols = sb * 256 + 64 * c + lane
    return lo, cols, hi, cols + 32


@triton.jit
def _q6_k(w_ptr, rows, nmask, row_bytes, sb0, NSB, r, BLOCK_N: tl.constexpr, SB: tl.constexpr):
    """Part r (0..3, at run time) of super-blocks sb0..sb0+SB (past NSB zeros): ([BLOCK_N, SB * 64], its
    columns). Position p = 32 * half + lane of a super-block holds value 128 * half + 32 * r + lane: the low
    (r < 2) or high nibble of ql[64 * half + lane + 32 * (r % 2)], and bits 2r of qh[32 * half + lane]."""
    sbs = sb0 + tl.arange(0, SB)
    smask = nmask[:, None] & (sbs[None, :] < NSB)
    base = (rows[:, None].to(tl.int64) * row_bytes + sbs[None, :] * 210)[:, :, None]  # [BLOCK_N, SB, 1]
    m3 = smask[:, :, None]
    pos = tl.arange(0, 64)
    half, lane = pos // 32, pos % 32
    ql = tl.load(w_ptr + base + (64 * half + lane + 32 * (r % 2))[None, None, :], mask=m3, other=0).to(tl.int32)
    qh = tl.load(w_ptr + base + 128 + (32 * half + lane)[None, None, :], mask=m3, other=0).to(tl.int32)
    d = _f16(w_ptr, base + 208, m3)
    nib = tl.where(r >= 2, ql >> 4, ql & 15)
    q = (nib | (((qh >> (2 * r)) & 3) << 4)).to(tl.float32) - 32.0
    scale = tl.load(w_ptr + base + 192 + (8 * half + lane // 16 + 2 * r)[None, None, :], mask=m3, other=0)
    w = q * d * scale.to(tl.int8, bitcast=True).to(tl.float32)
    cols = tl.reshape(sbs[:, None] * 256 + (128 * half + 32 * r + lane)[None, :], (SB * 64,))
    return tl.reshape(w, (BLOCK_N, SB * 64)), cols


@triton.jit
def _rows_times(acc, w, cols, x_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += x[m, cols] . w[n, :] for each row m of x, in fp32 on the CUDA cores."""
    which = tl.arange(0, BLOCK_M)[:, None]
    for m in tl.static_range(BLOCK_M):
        x = tl.load(x_ptr + m * stride_xm + cols, mask=(cols < K) & (cols * 0 + m < M), other=0.0).to(tl.float32)
        acc += tl.where(which == m, tl.sum(w * x[None, :], axis=1)[None, :], 0.0)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_os, stride_om, steps_per_split,
                 FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rows < N
    split = tl.program_id(1)
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, 256 * SB))
    nsb = tl.cdiv(K, 256)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, last):
        if FMT == 8:
            w, cols = _q8_0(w_ptr, rows, nmask, row_bytes, K, step * 256 * SB, BLOCK_N, 256 * SB)
            acc = _rows_times(acc, w, cols, x_ptr, M, K, stride_xm, BLOCK_M)
        elif FMT == 12:
            lo, c_lo, hi, c_hi = _q4_k(w_ptr, rows, nmask, row_bytes, step * SB, nsb, BLOCK_N, SB)
            acc = _rows_times(acc, lo, c_lo, x_ptr, M, K, stride_xm, BLOCK_M)
            acc = _rows_times(acc, hi, c_hi, x_ptr, M, K, stride_xm, BLOCK_M)
        else:
            for r in tl.static_range(4):
                w, cols = _q6_k(w_ptr, rows, nmask, row_bytes, step * SB, nsb, r, BLOCK_N, SB)
                acc = _rows_times(acc, w, cols, x_ptr, M, K, stride_xm, BLOCK_M)
    which = tl.arange(0, BLOCK_M)[:, None]
    out = out_ptr + split * stride_os + which * stride_om + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(which < M) & nmask[None, :])


@triton.jit
def _dot(acc, w, cols, x_ptr, offs_m, M, K, stride_xm, IEEE: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += x[offs_m, cols] @ w^T on the tensor cores, w cast to x's dtype."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=(offs_m[:, None] < M) & (cols[None, :] < K), other=0.0)
    wt = tl.trans(w.to(x_ptr.dtype.element_ty))
    if IEEE:  # fp32 x, or the interpreter (whose bf16 dot is wrong): the same roundings, multiplied in fp32
        return tl.dot(x.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, wt, acc)


@triton.jit
def _mm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om,
               FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rows < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FMT == 8:  # 64 values a step: a decoded tile small enough to stay in registers beside the accumulator
        for step in range(0, tl.cdiv(K, 64)):
            w, cols = _q8_0(w_ptr, rows, nmask, row_bytes, K, step * 64, BLOCK_N, 64)
            acc = _dot(acc, w, cols, x_ptr, offs_m, M, K, stride_xm, IEEE)
    elif FMT == 12:  # one 32-byte chunk of a super-block a step
        for step in range(0, K // 64):
            lo, c_lo, hi, c_hi = _q4_k_chunk(w_ptr, rows, nmask, row_bytes, step // 4, step % 4)
            acc = _dot(acc, lo, c_lo, x_ptr, offs_m, M, K, stride_xm, IEEE)
            acc = _dot(acc, hi, c_hi, x_ptr, offs_m, M, K, stride_xm, IEEE)
    else:  # one part of a super-block a step
        for step in range(0, K // 64):
            w, cols = _q6_k(w_ptr, rows, nmask, row_bytes, step // 4, K // 256, step % 4, BLOCK_N, 1)
            acc = _dot(acc, w, cols, x_ptr, offs_m, M, K, stride_xm, IEEE)
    out = out_ptr + offs_m[:, None] * stride_om + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & nmask[None, :])


@triton.jit
def _put(out_ptr, w, cols, rows, nmask, K):
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=nmask[:, None] & (cols[None, :] < K))


@triton.jit
def _dequantize_kernel(w_ptr, out_ptr, N, K, row_bytes, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rows < N
    step = tl.program_id(1)
    if FMT == 8:
        w, cols = _q8_0(w_ptr, rows, nmask, row_bytes, K, step * 256, BLOCK_N, 256)
        _put(out_ptr, w, cols, rows, nmask, K)
    elif FMT == 12:
        lo, c_lo, hi, c_hi = _q4_k(w_ptr, rows, nmask, row_bytes, step, K // 256, BLOCK_N, 1)
        _put(out_ptr, lo, c_lo, rows, nmask, K)
        _put(out_ptr, hi, c_hi, rows, nmask, K)
    else:
        for r in tl.static_range(4):
            w, cols = _q6_k(w_ptr, rows, nmask, row_bytes, step, K // 256, r, BLOCK_N, 1)
            _put(out_ptr, w, cols, rows, nmask, K)


def gemv(x: torch.Tensor, packed: torch.Tensor, kind: int, n: int, k: int, *, block_n: int = 4, sb: int = 1,
         split_k: int = 1, num_warps: int = 4) -> torch.Tensor:
    """x [M, k] (M up to 16) @ W^T -> [M, n] in x's dtype, W's bytes `packed` [n, row bytes] uint8; a program
    decodes `sb` super-blocks (Q8_0: 256 * sb values) of `block_n` rows a step."""
    m = x.shape[0]
    block_m = triton.next_power_of_2(m)
    steps = triton.cdiv(k, 256 * sb)
    split_k = max(1, min(split_k, steps))
    per_split = triton.cdiv(steps, split_k)
    split_k = triton.cdiv(steps, per_split)  # no empty splits
    out = torch.empty((split_k, m, n) if split_k > 1 else (1, m, n), device=x.device,
                      dtype=torch.float32 if split_k > 1 else x.dtype)
    grid = (triton.cdiv(n, block_n), split_k)
    _gemv_kernel[grid](x, packed, out, m, n, k, packed.stride(0), x.stride(0), out.stride(0), out.stride(1),
                       per_split, FMT=kind, BLOCK_M=block_m, BLOCK_N=block_n, SB=sb, num_warps=num_warps)
    return out[0] if split_k == 1 else out.sum(0).to(x.dtype)


def mm(x: torch.Tensor, packed: torch.Tensor, kind: int, n: int, k: int, *, block_m: int = 64, block_n: int = 64,
       num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [M, k] @ W^T -> [M, n] in x's dtype on the tensor cores (the decoded weights rounded to x's dtype)."""
    m = x.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _mm_kernel[grid](x, packed, out, m, n, k, packed.stride(0), x.stride(0), out.stride(0), FMT=kind,
                     BLOCK_M=block_m, BLOCK_N=block_n, IEEE=x.dtype == torch.float32 or INTERPRETED, num_warps=num_warps,
                     num_stages=num_stages)
    return out


def dequantize(packed: torch.Tensor, kind: int, n: int, k: int, dtype: torch.dtype, *, block_n: int = 16) -> torch.Tensor:
    """W [n, k] in `dtype` from its bytes `packed` [n, row bytes] uint8."""
    out = torch.empty((n, k), device=packed.device, dtype=dtype)
    if n:
        _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, 256))](packed, out, n, k, packed.stride(0),
                                                                         FMT=kind, BLOCK_N=block_n)
    return out
