"""Attention over the paged KV cache: new K/V written to their slots, then each row over its context.

`PagedRows` is built once a pass (host-side index math) and used by every layer. On the CPU an fp32 cache
is read in place by our kernel (lanes/quant/cpu_attention.cpp), a row's result independent of the pass's
other rows; elsewhere the ragged rows are gathered, padded and given to SDPA (decode on CUDA uses the
Triton kernel of the fast step instead). An fp8 cache
(`exponents` given) is written quantized and its gathered rows dequantized to q's dtype before SDPA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..quant.native import available
from . import fp8

KEY_ALIGN = 64  # keys padded to a multiple of this: few distinct shapes, and aligned rows for the kernels
# Not cuDNN's attention on CUDA: it builds a plan for every new shape, and a pass's shape changes every pass.
CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class RowSpan:
    """One lane's rows in a pass: `length` new tokens at positions `start`.. over its block table."""

    start: int
    length: int
    blocks: Sequence[int]


class PagedRows:
    """Index tensors for one pass, on the pass's device.

    slots: [T] where each new token's K/V goes; key_slots: [N] every lane's context slots in order, lanes
    one after another; row_first, row_len: [T] row t sees key_slots[first, first + len) (the CPU kernel's
    tables, built eagerly). The gather path's tensors are built on first use: q_index [B*Q] row of the flat
    queries for each padded query (0 for padding); k_slots [B*K] slot of each padded key (0 for padding);
    mask [B, 1, Q, K] which keys a query sees (padding rows see key 0 only, so no row is empty); out_index
    [T] padded row of each flat query.
    """

    def __init__(self, spans: Sequence[RowSpan], block_size: int, device: torch.device) -> None:
        self.spans, self.device = spans, device
        self.lanes = len(spans)
        self.max_q = max(s.length for s in spans)
        self.max_k = -(-max(s.start + s.length for s in spans) // KEY_ALIGN) * KEY_ALIGN
        slots, key_slots, first, lens = [], [], [], []
        offset = 0
        for span in spans:
            end = span.start + span.length
            if len(span.blocks) * block_size < end:
                raise ValueError(f"a block table of {len(span.blocks)} blocks cannot hold {end} tokens")
            positions = np.arange(end)
            lane_slots = np.asarray(span.blocks, np.int64)[positions // block_size] * block_size + positions % block_size
            key_slots.append(lane_slots)
            slots.append(lane_slots[span.start :])
            first.append(np.full(span.length, offset, np.int64))
            lens.append(np.arange(span.start + 1, end + 1, dtype=np.int64))
            offset += end
        self._key_slots = np.concatenate(key_slots)
        self.slots = self._put(np.concatenate(slots))
        self.key_slots = self._put(self._key_slots)
        self.row_first = self._put(np.concatenate(first))
        self.row_len = self._put(np.concatenate(lens))

    def _put(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @functools.cached_property
    def _gather(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        lanes, max_q, max_k = self.lanes, self.max_q, self.max_k
        q_index, out_index = np.zeros(lanes * max_q, np.int64), []
        k_slots = np.zeros(lanes * max_k, np.int64)
        mask = np.zeros((lanes, 1, max_q, max_k), np.bool_)
        mask[:, :, :, 0] = True  # padding rows see key 0; real rows see it anyway
        row = offset = 0
        for b, span in enumerate(self.spans):
            end = span.start + span.length
            k_slots[b * max_k : b * max_k + end] = self._key_slots[offset : offset + end]
            q_index[b * max_q : b * max_q + span.length] = np.arange(row, row + span.length)
            out_index.append(np.arange(b * max_q, b * max_q + span.length))
            query_pos = span.start + np.arange(span.length)
            mask[b, 0, : span.length, :max_k] = np.arange(max_k)[None, :] <= query_pos[:, None]
            row += span.length
            offset += end
        return self._put(q_index), self._put(k_slots), self._put(mask), self._put(np.concatenate(out_index))

    q_index = property(lambda self: self._gather[0])
    k_slots = property(lambda self: self._gather[1])
    mask = property(lambda self: self._gather[2])
    out_index = property(lambda self: self._gather[3])


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, rows: PagedRows, k: torch.Tensor, v: torch.Tensor,
             exponents: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Store the pass's new keys and values. cache_*: [S, Hkv, D]; k, v: [T, Hkv, D]; `exponents`: an fp8
    cache's (k_exp, v_exp) [S, Hkv] int8, written beside the quantized values."""
    if exponents is None:
        cache_k.index_copy_(0, rows.slots, k)
        cache_v.index_copy_(0, rows.slots, v)
        return
    for cache, exps, x in ((cache_k, exponents[0], k), (cache_v, exponents[1], v)):
        values, e = fp8.quantize(x)
        cache.view(torch.uint8).index_copy_(0, rows.slots, values.view(torch.uint8))  # no fp8 index_copy on the CPU
        exps.index_copy_(0, rows.slots, e)


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                   rows: PagedRows, heads: int, scale: float) -> torch.Tensor | None:
    """On the CPU in fp32, RoPE over whole heads, `write_kv` and `paged_attention` in one op (the same values):
    qkv [T, (Hq + 2 Hkv) D] -> [T, Hq D]. None where that op does not apply (the caller takes the parts)."""
    d = cache_k.shape[2]
    if (qkv.device.type == "cpu" and qkv.dtype == cos.dtype == sin.dtype == cache_k.dtype == torch.float32
            and cos.shape[-1] == d and qkv.dim() == 2 and qkv.stride(1) == 1 and available()):
        return torch.ops.lanes_quant.rope_attention(qkv, cos, sin, cache_k, cache_v, rows.slots, rows.key_slots,
                                                    rows.row_first, rows.row_len, heads, scale)
    return None


def paged_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, rows: PagedRows, scale: float,
                    exponents: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of each lane's new rows over its whole context. q: [T, Hq, D] -> [T, Hq, D]."""
    if q.device.type == "cpu" and exponents is None and q.dtype == cache_k.dtype == torch.float32 and available():
        return torch.ops.lanes_quant.paged_attention(q, cache_k, cache_v, rows.key_slots, rows.row_first, rows.row_len, scale)
    hq, d = q.shape[1], q.shape[2]
    hkv = cache_k.shape[1]
    # [B, Hq, Q, D] from the flat rows; [B, Hkv, K, D] from the cache.
    qp = q.index_select(0, rows.q_index).view(rows.lanes, rows.max_q, hq, d).transpose(1, 2)
    if exponents is None:
        kp, vp = cache_k.index_select(0, rows.k_slots), cache_v.index_select(0, rows.k_slots)  # [B*K, Hkv, D]
    else:  # gathered as bytes (index_select on fp8 is not on every device), then dequantized
        kp, vp = (fp8.dequantize(cache.view(torch.uint8).index_select(0, rows.k_slots).view(fp8.FP8),
                                 e.index_select(0, rows.k_slots), q.dtype)
                  for cache, e in ((cache_k, exponents[0]), (cache_v, exponents[1])))
    kp = kp.view(rows.lanes, rows.max_k, hkv, d).transpose(1, 2)
    vp = vp.view(rows.lanes, rows.max_k, hkv, d).transpose(1, 2)
    if q.is_cuda:
        if hq != hkv:  # the efficient kernel takes as many key heads as query heads
            kp, vp = kp.repeat_interleave(hq // hkv, dim=1), vp.repeat_interleave(hq // hkv, dim=1)
        with sdpa_kernel(CUDA_BACKENDS):
            out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=rows.mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=rows.mask, scale=scale, enable_gqa=hq != hkv)
    # [B, Hq, Q, D] -> [B*Q, Hq, D] -> the flat rows.
    return out.transpose(1, 2).reshape(rows.lanes * rows.max_q, hq, d).index_select(0, rows.out_index)
