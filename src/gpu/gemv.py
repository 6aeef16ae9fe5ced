"""Small-batch GEMV kernels (M = 1..16 rows) for the decode step, with what feeds each projection fused in.

x [M, K] @ weight[N, K]^T accumulated in float32 and rounded once, as F.linear does. The fused variants do
the step before a projection inside its load of x, so that intermediate never goes through memory and one
launch replaces two: the residual add and RMSNorm (`norm_gemv`), SiLU and the product (`silu_gemv`), and
both ends of the MLP's first projection (`norm_gate_up_silu`). Their prologues and epilogues compute and
round exactly as kernels.add_rms_norm and kernels.silu_mul do.

A program owns BLOCK_M rows and BLOCK_N output columns and walks K in BLOCK_K chunks. With split_k > 1 the
programs of a tile share K: each writes float32 partials, and the last to arrive (counted on a semaphore it
then zeroes) sums them in split order and writes the tile, so a split GEMV is still one launch. The FMA path
multiplies and sums on the CUDA cores (the defaults' choice up to 4 rows); the dot path pads rows to 16 for
the tensor cores. `default_config` and its siblings pick tiles by shape (measured with bench/gemv.py).
Imported only where Triton is (the tests run the kernels on the CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .paged_kernel import arrival_counts

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PLAIN, NORM, SILU = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # what a program does to x as it loads it
COUNTER_SLOTS = 1 << 16  # split-K semaphores: one a tile, so at most this many tiles in a split launch


@dataclass(frozen=True)
class GemvConfig:
    """One tile shape. `dot` multiplies on the tensor cores and needs block_m, block_n, block_k >= 16;
    `num_stages` pipelines the dot path's loop (the FMA path's loop is unrolled instead)."""

    block_n: int
    block_k: int
    split_k: int = 1
    block_m: int = 1
    dot: bool = False
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        path = f"dot st{self.num_stages}" if self.dot else "fma"
        return f"{path} m{self.block_m} n{self.block_n} k{self.block_k} s{self.split_k} w{self.num_warps}"


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """The tile for an [m, k] x [n, k]^T product (gemv, norm_gemv), from bench/gemv.py's sweep on an H200
    over Qwen2.5-0.5B's projections: each tile here within about 5% of the sweep's best. One row: FMA over
    whole 1024-wide chunks, few weight rows a program so that programs are many (1 for long rows, 2 for
    small N, 4, 8 past 64k columns). Two to four rows of a small matrix (two when rows are long): FMA
    still. Else the dot path, 16 rows a tile: long rows (K > 1024) 32 columns with K split for about 132
    programs; small N 16 columns; large N 128 columns up to 8 rows, 32 up to 16. Past 16 rows (outside
    the design: cuBLAS wins on large N) 64-row tiles for large N."""
    if m == 1:
        return GemvConfig(block_n=1 if k > 1024 else 2 if n <= 2048 else 4 if n < 65536 else 8, block_k=1024)
    if m <= 4 and n <= 2048 and (k <= 1024 or m == 2):
        return GemvConfig(block_n=2, block_k=1024 if m == 2 else 512, block_m=triton.next_power_of_2(m))
    block_m = 64 if m > 16 and n >= 8192 else 16
    if k > 1024:
        tiles = triton.cdiv(n, 32) * triton.cdiv(m, block_m)
        split = max(1, min(triton.cdiv(k, 128), triton.cdiv(132, tiles)))
        return GemvConfig(32, 128, split_k=split, block_m=block_m, dot=True, num_stages=4)
    if n <= 2048:
        return GemvConfig(16 if m <= 16 else 64, 128, block_m=block_m, dot=True, num_stages=4)
    if m <= 8 or m > 16:
        return GemvConfig(128, 128, block_m=block_m, dot=True, num_stages=3)
    return GemvConfig(32, 128, block_m=16, dot=True, num_stages=4)


def silu_config(m: int, n: int, k: int) -> GemvConfig:
    """silu_gemv's default: a program recomputes silu(gate) * up over all the K it reads, so its tiles are
    wider than the plain rule's (fewer programs, less recomputing): 4 columns by 2048 at one row, 4 by
    1024 at two; on the dot path 64 columns, K split for about 132 programs."""
    if m <= 2:
        return GemvConfig(4, 2048 if m == 1 else 1024, block_m=m)
    config = default_config(m, n, k)
    if not config.dot:
        return config
    tiles = triton.cdiv(n, 64) * triton.cdiv(m, config.block_m)
    split = max(1, min(triton.cdiv(k, 128), triton.cdiv(132, tiles)))
    return GemvConfig(64, 128, split_k=split, block_m=config.block_m, dot=True, num_stages=4)


def gated_config(m: int, n: int, k: int) -> GemvConfig:
    """norm_gate_up_silu's default: a program reads gate's and up's rows, so half the columns of the plain
    rule's tile for the same rows (not below the dot path's 16)."""
    config = default_config(m, 2 * n, k)
    return GemvConfig(**{**config.__dict__, "block_n": max(16 if config.dot else 1, config.block_n // 2)})


@triton.jit
def _norm_scales(x_ptr, res_ptr, res_out_ptr, first, M, n_cols, eps, x_stride, res_stride, res_out_stride,
                 store_rows, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """rsqrt(mean(row^2) + eps) for rows first.. of x (+ residual), each row summed as one [NORM_BLOCK]
    vector exactly as _add_rms_norm_kernel sums it, so the scales are its scales. Stores x + residual's
    rows below `store_rows` (M in the one program that writes them, else 0)."""
    cols = tl.arange(0, NORM_BLOCK)
    ok = cols < n_cols
    slots = tl.arange(0, BLOCK_M)
    scales = tl.zeros([BLOCK_M], dtype=tl.float32)
    top = tl.minimum(first, M - 1)
    x_next = tl.load(x_ptr + top * x_stride + cols, mask=ok, other=0.0)
    r_next = tl.load(res_ptr + top * res_stride + cols, mask=ok, other=0.0) if HAS_RESIDUAL else x_next
    for i in tl.static_range(BLOCK_M):
        row = first + i
        x, r = x_next, r_next
        if i + 1 < BLOCK_M:  # the next row loads while this one is summed (each sum ends at a barrier)
            x_next = tl.load(x_ptr + tl.minimum(row + 1, M - 1) * x_stride + cols, mask=ok, other=0.0)
            if HAS_RESIDUAL:
                r_next = tl.load(res_ptr + tl.minimum(row + 1, M - 1) * res_stride + cols, mask=ok, other=0.0)
        if row < M:  # rows past M (padding to the tensor cores' 16) keep scale 0 and are never stored
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # added in the model dtype
                keep = tl.full([NORM_BLOCK], row, tl.int32) < store_rows  # a splat: the mask stays as ok's
                tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=ok & keep)
            x32 = x.to(tl.float32)
            scales = tl.where(slots == i, tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps), scales)
    return scales


@triton.jit
def _load_x(x_ptr, res_ptr, nw_ptr, rows, scales, offs_k, x_stride, res_stride, K: tl.constexpr,
            MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, MASK_K: tl.constexpr):
    """The GEMV's input at rows x offs_k, [BLOCK_M, BLOCK_K] in x's dtype: x itself, or
    RMSNorm(x + residual) * norm weight, or silu(gate) * up, each rounded where the eager path rounds."""
    ptrs = x_ptr + rows[:, None] * x_stride + offs_k[None, :]
    dtype = x_ptr.dtype.element_ty
    if MODE == SILU:  # x_ptr is gate_up [M, 2K]: gate then up
        gate = _masked_load(ptrs, offs_k[None, :], K, MASK_K).to(tl.float32)
        up = _masked_load(ptrs + K, offs_k[None, :], K, MASK_K).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # silu_mul rounds silu's result
        x = (act * up).to(dtype)
    else:
        x = _masked_load(ptrs, offs_k[None, :], K, MASK_K)
        if MODE == NORM:
            if HAS_RESIDUAL:
                res = _masked_load(res_ptr + rows[:, None] * res_stride + offs_k[None, :], offs_k[None, :], K, MASK_K)
                x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
            w = _masked_load(nw_ptr + offs_k, offs_k, K, MASK_K)
            normed = x.to(tl.float32) * scales[:, None]
            x = (normed.to(dtype).to(tl.float32) * w.to(tl.float32)[None, :]).to(dtype)
    return x


@triton.jit
def _masked_load(ptrs, offs_k, K: tl.constexpr, MASK_K: tl.constexpr):
    """Loads ptrs, zero where offs_k >= K; unmasked where every chunk lies inside K."""
    if MASK_K:
        return tl.load(ptrs, mask=offs_k < K, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _load_w(w_ptr, w_rows, offs_k, K: tl.constexpr, MASK_K: tl.constexpr):
    """weight[w_rows, offs_k]: [BLOCK_N, BLOCK_K]; w_rows are element offsets of whole rows (int64)."""
    return _masked_load(w_ptr + w_rows[:, None] + offs_k[None, :], offs_k[None, :], K, MASK_K)


@triton.jit
def _mma(w, x, acc, IEEE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += w [BLOCK_N, BLOCK_K] @ x^T."""
    if IEEE:  # float32 operands get exact float32 products; so does the interpreter, which has no bf16 dot
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _fma(acc, x, w, BLOCK_M: tl.constexpr):
    """acc += w * x elementwise: [BLOCK_N, BLOCK_K] for one row, [BLOCK_M, BLOCK_N, BLOCK_K] for more;
    summed over K once, after the loop, so the loop body is loads and FMAs alone."""
    if BLOCK_M == 1:
        return acc + w.to(tl.float32) * x.to(tl.float32)
    else:
        return acc + w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]


@triton.jit
def _finish(acc, acc_up, b_ptr, out_ptr, rows, cols, M, N, out_stride, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """Bias, then (gated) silu(gate) * up as F.linear followed by silu_mul round it; stores the tile."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + tl.minimum(cols, N - 1)).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptr + N + tl.minimum(cols, N - 1)).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)  # F.linear rounds gate_up to the model dtype
        up = acc_up.to(dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], acc.to(dtype),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["M", "N"])
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, part_ptr, count_ptr,
                 M, N, eps, n_cols, x_stride, res_stride, res_out_stride, out_stride,
                 K: tl.constexpr, MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, CHUNKS: tl.constexpr, PER_SPLIT: tl.constexpr, MASK_K: tl.constexpr,
                 DOT: tl.constexpr, IEEE: tl.constexpr, NORM_BLOCK: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)  # this program's K chunks: split * PER_SPLIT onwards
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = tl.minimum(rows, M - 1)  # rows and columns past the end repeat the last; they are never stored
    w_rows = tl.minimum(cols, N - 1).to(tl.int64) * K
    up_rows = w_rows + N.to(tl.int64) * K  # gated: up's weight rows follow gate's
    first = split * PER_SPLIT
    if not DOT:  # the first chunk's weights load while the norm's sums are taken
        offs_k = first * BLOCK_K + tl.arange(0, BLOCK_K)
        w = _load_w(w_ptr, w_rows, offs_k, K, MASK_K)
        w_up = _load_w(w_ptr, up_rows, offs_k, K, MASK_K) if GATED else w
    scales = tl.zeros([BLOCK_M], dtype=tl.float32)
    if MODE == NORM:
        scales = _norm_scales(x_ptr, res_ptr, res_out_ptr, pid_m * BLOCK_M, M, n_cols, eps, x_stride, res_stride,
                              res_out_stride, M * ((pid_n + split) == 0).to(tl.int32), HAS_RESIDUAL, BLOCK_M,
                              NORM_BLOCK)
    if DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for chunk in range(first, tl.minimum(first + PER_SPLIT, CHUNKS)):
            offs_k = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
            x = _load_x(x_ptr, res_ptr, nw_ptr, x_rows, scales, offs_k, x_stride, res_stride, K, MODE, HAS_RESIDUAL,
                        MASK_K)
            acc = _mma(_load_w(w_ptr, w_rows, offs_k, K, MASK_K), x, acc, IEEE)
            if GATED:
                acc_up = _mma(_load_w(w_ptr, up_rows, offs_k, K, MASK_K), x, acc_up, IEEE)
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    else:
        if BLOCK_M == 1:
            wide = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            wide_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            wide = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
            wide_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for i in tl.static_range(PER_SPLIT):  # unrolled, each chunk's weights loaded a chunk ahead
            offs_k = (first + i) * BLOCK_K + tl.arange(0, BLOCK_K)
            if i + 1 < PER_SPLIT:
                w_next = _load_w(w_ptr, w_rows, offs_k + BLOCK_K, K, MASK_K)
                w_up_next = _load_w(w_ptr, up_rows, offs_k + BLOCK_K, K, MASK_K) if GATED else w_next
            x = _load_x(x_ptr, res_ptr, nw_ptr, x_rows, scales, offs_k, x_stride, res_stride, K, MODE, HAS_RESIDUAL,
                        MASK_K)
            wide = _fma(wide, x, w, BLOCK_M)
            if GATED:
                wide_up = _fma(wide_up, x, w_up, BLOCK_M)
            if i + 1 < PER_SPLIT:
                w, w_up = w_next, w_up_next
        if BLOCK_M == 1:
            acc = tl.sum(wide, axis=1)[None, :]
            acc_up = tl.sum(wide_up, axis=1)[None, :]
        else:
            acc = tl.sum(wide, axis=2)
            acc_up = tl.sum(wide_up, axis=2)
    if SPLIT_K == 1:
        _finish(acc, acc_up, b_ptr, out_ptr, rows, cols, M, N, out_stride, HAS_BIAS, GATED)
    else:
        halves: tl.constexpr = 2 if GATED else 1
        inside = (rows < M)[:, None] & (cols < N)[None, :]
        parts = part_ptr + rows[:, None] * N + cols[None, :]  # partials: [SPLIT_K, halves, M, N] float32
        plane = M * N
        tl.store(parts + split * halves * plane, acc, mask=inside)
        if GATED:
            tl.store(parts + (split * 2 + 1) * plane, acc_up, mask=inside)
        tl.debug_barrier()  # all threads' partials are written before one thread counts them (CUTLASS's semaphore)
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the tile's last program: every other partial is in memory
            tl.debug_barrier()  # the partials' loads follow the one thread's acquire
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order, whichever program arrives last: deterministic
                acc += tl.load(parts + s * halves * plane, mask=inside, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(parts + (s * 2 + 1) * plane, mask=inside, other=0.0, cache_modifier=".cg")
            _finish(acc, acc_up, b_ptr, out_ptr, rows, cols, M, N, out_stride, HAS_BIAS, GATED)
            tl.store(count_ptr + tile, 0)  # zero again for the next launch


def _launch(mode: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig | None,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    n, k = weight.shape[0] // (2 if gated else 1), weight.shape[1]
    if weight.stride(1) != 1 or weight.stride(0) != k or x.stride(-1) != 1:
        raise ValueError("gemv needs a row-major weight and x with unit column stride")
    if x.shape[1] != (2 * k if mode == SILU else k):
        raise ValueError(f"x has {x.shape[1]} columns for a weight of {k}")
    if config is None:
        config = gated_config(m, n, k) if gated else silu_config(m, n, k) if mode == SILU else default_config(m, n, k)
    if config.dot and min(config.block_m, config.block_n, config.block_k) < 16:
        raise ValueError(f"{config}: the dot path needs tiles of at least 16")
    chunks = triton.cdiv(k, config.block_k)
    per_split = triton.cdiv(chunks, config.split_k)
    split = triton.cdiv(chunks, per_split)  # no split left without a chunk
    grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, config.block_m))
    out = x.new_empty(m, n)
    res_out = x.new_empty(m, k) if mode == NORM and residual is not None else x
    if split > 1:
        if grid[0] * grid[2] > COUNTER_SLOTS:
            raise ValueError(f"{config}: {grid[0] * grid[2]} tiles, more than the {COUNTER_SLOTS} semaphores")
        parts = torch.empty(split * (2 if gated else 1) * m * n, device=x.device, dtype=torch.float32)
        counters = arrival_counts(x.device, COUNTER_SLOTS, "gemv")  # one a tile
    else:
        parts, counters = out, out  # not read
    _gemv_kernel[grid](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, out, res_out, parts, counters,
        m, n, eps, k, x.stride(0), residual.stride(0) if residual is not None else x.stride(0), res_out.stride(0),
        out.stride(0),
        K=k, MODE=mode, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, GATED=gated,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, CHUNKS=chunks,
        PER_SPLIT=per_split, MASK_K=k % config.block_k != 0 or (not config.dot and chunks % per_split != 0),
        DOT=config.dot, IEEE=weight.dtype == torch.float32 or INTERPRETED, NORM_BLOCK=triton.next_power_of_2(k),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, res_out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [M, K], weight [N, K], bias [N] -> [M, N] in x's dtype."""
    return _launch(PLAIN, x, weight, bias, config)[0]


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None,
              config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(h, weight, bias), x + residual) where (h, x + residual) = kernels.add_rms_norm(x, residual,
    norm_weight, eps), h never leaving the kernel. x, residual: [M, K] -> ([M, N], [M, K]); the new residual
    is a fresh tensor (x itself with no residual). h is add_rms_norm's bit for bit: each row's sum of
    squares is reduced as add_rms_norm reduces it (the same [next_pow2(K)] vector at num_warps=4, its
    launch's; checked on an H200 for every tile bench/gemv.py sweeps, num_warps=8 too)."""
    return _launch(NORM, x, weight, bias, config, residual, norm_weight, eps)


def silu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(kernels.silu_mul(gate_up), weight, bias), the product never leaving the kernel.
    gate_up: [M, 2I] (gate then up), weight: [N, I] -> [M, N]."""
    return _launch(SILU, gate_up, weight, bias, config)[0]


def norm_gate_up_silu(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu_mul(F.linear(h, weight, bias)), x + residual) with h as in `norm_gemv`; neither h nor the
    [M, 2I] gate_up exists: a program computes columns j of gate (weight rows j) and of up (rows I + j).
    weight: [2I, K] -> ([M, I], [M, K])."""
    return _launch(NORM, x, weight, bias, config, residual, norm_weight, eps, gated=True)
