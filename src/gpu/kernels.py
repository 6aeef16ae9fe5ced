"""Triton kernels of the decode path: paged attention over the block pool (`paged_kernel.py`), and the
fusions that cut a layer's launches from ~35 to 9 (residual add with RMSNorm, RoPE with the KV write, SiLU
with the product). The KV write quantizes for an fp8 cache (`fp8_triton.py`).

Imported only where Triton is (the CUDA path; tests run them on the CPU under TRITON_INTERPRET=1). Each
kernel computes in float32 and rounds where the eager path rounds, so greedy tokens agree with it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import fp8_triton as f8
from .paged_kernel import arrival_counts, arrival_scope, context_splits, paged_decode_attention  # noqa: F401 (the decode path's kernels, one namespace)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, rows_ptr, out_ptr, res_out_ptr, eps, n_cols,
                         x_stride, res_stride, out_stride, HAS_RESIDUAL: tl.constexpr, PICKED: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    source = tl.load(rows_ptr + row) if PICKED else row  # with picked rows, output row i is input row rows[i]
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + source * x_stride + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + source * res_stride + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)  # the eager path adds in the model dtype
    tl.store(res_out_ptr + row * res_stride + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    normed = x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    out = normed.to(out_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 residual_out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); with no residual, x itself is the new residual.

    x, residual: [T, H] -> ([T, H], [T, H]). `residual_out` may be `residual` (updated in place).
    `rows` [R] int64: only those rows, in that order -> ([R, H], [R, H]) (the last norm before the head).
    """
    count, cols = x.shape if rows is None else (rows.shape[0], x.shape[1])
    out = x.new_empty(count, cols)
    res_out = x.new_empty(count, cols) if residual_out is None else residual_out
    if residual is not None and residual.stride(0) != res_out.stride(0):
        raise ValueError("the residual and its output need the same row stride")
    _add_rms_norm_kernel[(count,)](
        x, residual if residual is not None else x, weight, rows if rows is not None else x, out, res_out, eps, cols,
        x.stride(0), res_out.stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, PICKED=rows is not None, BLOCK=triton.next_power_of_2(cols),
    )
    return out, res_out


@triton.jit
def _fed_embedding_kernel(tokens_ptr, feed_ptr, drawn_ptr, weight_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    fed = tl.load(feed_ptr + row)
    token = tl.load(drawn_ptr + tl.maximum(fed, 0)) if fed >= 0 else tl.load(tokens_ptr + row)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    tl.store(out_ptr + row * n_cols + cols, tl.load(weight_ptr + token.to(tl.int64) * n_cols + cols, mask=ok), mask=ok)


def fed_embedding(tokens: torch.Tensor, feed: torch.Tensor, drawn: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each row's embedding, of `drawn[feed[i]]` where feed[i] >= 0 (a fed row) else of `tokens[i]`.

    tokens, feed: [B] int64; drawn: [N] int64; weight: [V, H] contiguous -> [B, H]. One launch."""
    rows, cols = tokens.shape[0], weight.shape[1]
    out = weight.new_empty(rows, cols)
    _fed_embedding_kernel[(rows,)](tokens, feed, drawn, weight, out, cols, BLOCK=triton.next_power_of_2(cols))
    return out


@triton.jit
def _rope_write_kernel(qkv_ptr, positions_ptr, slots_ptr, inv_freq_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                       k_exp_ptr, v_exp_ptr, attention_scale, qkv_stride, q_out_stride_t, q_out_stride_h, kv_stride_s,
                       kv_stride_h, exp_stride_s, HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HALF: tl.constexpr, PASS: tl.constexpr, PASS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
                       FP8: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)  # 0..HQ-1: a query head; HQ..HQ+HKV-1: a key head (with its value head)
    half = tl.arange(0, HALF)  # the rotated pairs: dimensions i and HALF + i of the first 2 * HALF
    position = tl.load(positions_ptr + token).to(tl.float32)
    freqs = position * tl.load(inv_freq_ptr + half)
    cos = (tl.cos(freqs) * attention_scale).to(q_out_ptr.dtype.element_ty).to(tl.float32)
    sin = (tl.sin(freqs) * attention_scale).to(q_out_ptr.dtype.element_ty).to(tl.float32)
    base = qkv_ptr + token * qkv_stride + head * HEAD_DIM
    x1 = tl.load(base + half).to(tl.float32)
    x2 = tl.load(base + HALF + half).to(tl.float32)
    dtype = q_out_ptr.dtype.element_ty
    # The eager path rounds each product and the sum to the model dtype.
    lo = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    hi = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    rest = 2 * HALF + tl.arange(0, PASS_PAD)  # partial rotary: the dimensions past the rotated ones, as they are
    rest_ok = rest < HEAD_DIM
    if head < HQ:
        out = q_out_ptr + token * q_out_stride_t + head * q_out_stride_h
        tl.store(out + half, lo)
        tl.store(out + HALF + half, hi)
        if PASS > 0:
            tl.store(out + rest, tl.load(base + rest, mask=rest_ok), mask=rest_ok)
    else:
        kv_head = head - HQ
        slot = tl.load(slots_ptr + token).to(tl.int64)
        k_out = k_cache_ptr + slot * kv_stride_s + kv_head * kv_stride_h
        v_in = qkv_ptr + token * qkv_stride + (HQ + HKV + kv_head) * HEAD_DIM
        v_out = v_cache_ptr + slot * kv_stride_s + kv_head * kv_stride_h
        if FP8:  # each head's exponent from its largest element, as `fp8.quantize` takes it
            lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
            k_rest = tl.load(base + rest, mask=rest_ok, other=0.0).to(tl.float32)  # none without partial rotary
            k_max = tl.maximum(tl.maximum(tl.max(tl.abs(lo32), axis=0), tl.max(tl.abs(hi32), axis=0)),
                               tl.max(tl.abs(k_rest), axis=0))
            k_exp = f8.exponent_of(k_max)
            tl.store(k_out + half, f8.quantize(lo32, k_exp))
            tl.store(k_out + HALF + half, f8.quantize(hi32, k_exp))
            if PASS > 0:
                tl.store(k_out + rest, f8.quantize(k_rest, k_exp), mask=rest_ok)
            dims = tl.arange(0, HEAD_PAD)
            v = tl.load(v_in + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)
            v_exp = f8.exponent_of(tl.max(tl.abs(v), axis=0))
            tl.store(v_out + dims, f8.quantize(v, v_exp), mask=dims < HEAD_DIM)
            tl.store(k_exp_ptr + slot * exp_stride_s + kv_head, k_exp.to(tl.int8))
            tl.store(v_exp_ptr + slot * exp_stride_s + kv_head, v_exp.to(tl.int8))
        else:
            tl.store(k_out + half, lo.to(k_cache_ptr.dtype.element_ty))
            tl.store(k_out + HALF + half, hi.to(k_cache_ptr.dtype.element_ty))
            if PASS > 0:
                tl.store(k_out + rest, tl.load(base + rest, mask=rest_ok).to(k_cache_ptr.dtype.element_ty), mask=rest_ok)
                dims = tl.arange(0, HEAD_PAD)
                tl.store(v_out + dims, tl.load(v_in + dims, mask=dims < HEAD_DIM), mask=dims < HEAD_DIM)
            else:
                tl.store(v_out + half, tl.load(v_in + half))
                tl.store(v_out + HALF + half, tl.load(v_in + HALF + half))


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, inv_freq: torch.Tensor,
                  attention_scale: float, cache_k: torch.Tensor, cache_v: torch.Tensor, hq: int, hkv: int,
                  head_dim: int, q_out: torch.Tensor | None = None, rotary_dim: int | None = None,
                  k_exp: torch.Tensor | None = None, v_exp: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q and k by their positions; store k and v in the cache at `slots`; return the rotated q.

    qkv: [T, (hq + 2 hkv) * D] with q/k already normed where the family norms them; positions, slots: [T];
    inv_freq: [R / 2] float32 -> q: [T, hq, D]. `rotary_dim` R (default D): only each head's first R
    dimensions rotate, the rest pass through (partial rotary). An fp8 cache (float8_e4m3fn) comes with
    `k_exp`, `v_exp` [S, hkv] int8: each written head's exponent goes there.
    """
    tokens = qkv.shape[0]
    rotary = head_dim if rotary_dim is None else rotary_dim
    passed = head_dim - rotary
    fp8 = k_exp is not None
    q_out = torch.empty(tokens, hq, head_dim, device=qkv.device, dtype=qkv.dtype) if q_out is None else q_out
    _rope_write_kernel[(tokens, hq + hkv)](
        qkv, positions, slots, inv_freq, q_out, cache_k, cache_v, k_exp if fp8 else slots, v_exp if fp8 else slots,
        attention_scale, qkv.stride(0), q_out.stride(0), q_out.stride(1), cache_k.stride(0), cache_k.stride(1),
        k_exp.stride(0) if fp8 else 0,
        HQ=hq, HKV=hkv, HEAD_DIM=head_dim, HALF=rotary // 2, PASS=passed,
        PASS_PAD=triton.next_power_of_2(max(passed, 1)), HEAD_PAD=triton.next_power_of_2(head_dim), FP8=fp8,
    )
    return q_out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # the eager path rounds silu's result
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up: [T, I]."""
    rows, width = gate_up.shape
    half = width // 2
    out = torch.empty(rows, half, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(half, block))](gate_up, out, half, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
