"""The paged decode attention kernel: each query row over its context, read through its block table, on
the tensor cores, with the context split over several programs when lanes are few. An fp8 cache's keys
and values are dequantized tile by tile (each token's head scaled by its power of two) into q's dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch
import triton
import triton.language as tl

from .fp8_triton import power_of

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, k_exp_ptr, v_exp_ptr, tables_ptr, table, kv_head, start, length, scale, best, total,
                 acc, kv_stride_s, kv_stride_h, exp_stride_s, tables_stride, dims, dim_ok, BLOCK_SIZE: tl.constexpr,
                 TILE: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    """One tile of a lane's context on the tensor cores: scores, the online softmax, the weighted values."""
    positions = start + tl.arange(0, TILE)
    valid = positions < length
    blocks = tl.load(tables_ptr + table * tables_stride + positions // BLOCK_SIZE, mask=valid, other=0)
    slots = blocks.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    kv_mask = valid[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + slots[:, None] * kv_stride_s + kv_head * kv_stride_h + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slots[:, None] * kv_stride_s + kv_head * kv_stride_h + dims[None, :], mask=kv_mask, other=0.0)
    if FP8:  # exact: an e4m3 value times a power of two fits q's dtype
        k_exp = tl.load(k_exp_ptr + slots * exp_stride_s + kv_head, mask=valid, other=0).to(tl.int32)
        v_exp = tl.load(v_exp_ptr + slots * exp_stride_s + kv_head, mask=valid, other=0).to(tl.int32)
        k = (k.to(tl.float32) * power_of(k_exp)[:, None]).to(q.dtype)
        v = (v.to(tl.float32) * power_of(v_exp)[:, None]).to(q.dtype)
    if IEEE:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale  # [GROUP_PAD, TILE]
    else:
        scores = tl.dot(q, tl.trans(k)) * scale
    scores = tl.where(valid[None, :], scores, float("-inf"))
    tile_best = tl.maximum(best, tl.max(scores, axis=1))
    safe = tl.where(tile_best == float("-inf"), 0.0, tile_best)  # a tile past the length keeps exp() away from -inf - -inf
    rescale = tl.exp(best - safe)
    weights = tl.exp(scores - safe[:, None])
    total = total * rescale + tl.sum(weights, axis=1)
    if IEEE:
        probs = weights.to(v.dtype).to(tl.float32)  # rounded as the bf16 path rounds them
        acc = acc * rescale[:, None] + tl.dot(probs, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
    return tile_best, total, acc


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, k_exp_ptr, v_exp_ptr, out_ptr, part_acc_ptr, part_stats_ptr, arrivals_ptr,
                         tables_ptr, table_rows_ptr, lens_ptr, scale,
                         q_stride_b, q_stride_h, kv_stride_s, kv_stride_h, exp_stride_s, out_stride_b, out_stride_h,
                         tables_stride,
                         MAX_TOKENS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr,
                         LOOP_TO_LENGTH: tl.constexpr, IEEE: tl.constexpr, TABLE_ROWS: tl.constexpr,
                         FUSED: tl.constexpr, SPLITS_PAD: tl.constexpr, FP8: tl.constexpr):
    lane = tl.program_id(0)  # a query row; its table row is its own, or (prompt rows of one lane) a shared one
    kv_head = tl.program_id(1)
    split = tl.program_id(2)  # this program's share of the context: tiles split, split + SPLITS, ...
    rows = tl.arange(0, GROUP_PAD)  # the query heads that share this KV head
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + lane * q_stride_b + q_heads[:, None] * q_stride_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [GROUP_PAD, BLOCK_D], the model's dtype
    length = tl.load(lens_ptr + lane)
    table = tl.load(table_rows_ptr + lane) if TABLE_ROWS else lane
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    # On a GPU the loop stops at the lane's length (read on the device, so a captured graph stays right);
    # Triton's interpreter cannot bound a loop by a loaded value, so there it runs to the table's end.
    if LOOP_TO_LENGTH:
        for start in range(split * TILE, length, SPLITS * TILE):
            best, total, acc = _attend_tile(q, k_ptr, v_ptr, k_exp_ptr, v_exp_ptr, tables_ptr, table, kv_head, start, length,
                                            scale, best, total, acc, kv_stride_s, kv_stride_h, exp_stride_s, tables_stride,
                                            dims, dim_ok, BLOCK_SIZE, TILE, IEEE, FP8)
    else:
        for start in range(split * TILE, MAX_TOKENS, SPLITS * TILE):
            best, total, acc = _attend_tile(q, k_ptr, v_ptr, k_exp_ptr, v_exp_ptr, tables_ptr, table, kv_head, start, length,
                                            scale, best, total, acc, kv_stride_s, kv_stride_h, exp_stride_s, tables_stride,
                                            dims, dim_ok, BLOCK_SIZE, TILE, IEEE, FP8)
    if SPLITS == 1:
        out = acc / total[:, None]
        tl.store(out_ptr + lane * out_stride_b + q_heads[:, None] * out_stride_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:  # the partial softmax of this split; splits past the length leave best -inf
        head = lane * tl.num_programs(1) + kv_head
        part = head * SPLITS + split
        tl.store(part_acc_ptr + part * GROUP_PAD * BLOCK_D + rows[:, None] * BLOCK_D + dims[None, :], acc)
        tl.store(part_stats_ptr + part * 2 * GROUP_PAD + rows, best)
        tl.store(part_stats_ptr + part * 2 * GROUP_PAD + GROUP_PAD + rows, total)
        if FUSED:  # the split that arrives last combines them all: no second launch
            tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
            arrived = tl.atomic_add(arrivals_ptr + head, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                tl.atomic_xchg(arrivals_ptr + head, 0, sem="relaxed", scope="gpu")  # ready for the next call (and replay)
                _combine(part_acc_ptr, part_stats_ptr, out_ptr, out_stride_b, out_stride_h, lane, head, kv_head,
                         GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, SPLITS, SPLITS_PAD)


@triton.jit
def _combine_splits_kernel(part_acc_ptr, part_stats_ptr, out_ptr, out_stride_b, out_stride_h,
                           GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    lane, kv_head = tl.program_id(0), tl.program_id(1)
    _combine(part_acc_ptr, part_stats_ptr, out_ptr, out_stride_b, out_stride_h, lane, lane * tl.num_programs(1) + kv_head,
             kv_head, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, SPLITS, SPLITS_PAD)


@triton.jit
def _combine(part_acc_ptr, part_stats_ptr, out_ptr, out_stride_b, out_stride_h, lane, head, kv_head,
             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
             SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One (lane, KV head)'s splits merged: each partial weighted by its share of the softmax."""
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    splits = tl.arange(0, SPLITS_PAD)
    first = head * SPLITS
    stats = part_stats_ptr + (first + splits)[:, None] * 2 * GROUP_PAD + rows[None, :]  # [SPLITS_PAD, GROUP_PAD]
    # Loads skip the L1 cache: other multiprocessors wrote these partials.
    bests = tl.load(stats, mask=(splits < SPLITS)[:, None], other=float("-inf"), cache_modifier=".cg")
    totals = tl.load(stats + GROUP_PAD, mask=(splits < SPLITS)[:, None], other=0.0, cache_modifier=".cg")
    best = tl.max(bests, axis=0)  # [GROUP_PAD]: finite, split 0 always holds the first tile
    total = tl.sum(totals * tl.exp(bests - best[None, :]), axis=0)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for split in tl.static_range(SPLITS):  # unrolled: the loads are independent and issue back to back
        part = first + split
        weight = tl.exp(tl.load(part_stats_ptr + part * 2 * GROUP_PAD + rows, cache_modifier=".cg") - best)
        acc += tl.load(part_acc_ptr + part * GROUP_PAD * BLOCK_D + rows[:, None] * BLOCK_D + dims[None, :],
                       cache_modifier=".cg") * weight[:, None]
    q_heads = kv_head * GROUP + rows
    tl.store(out_ptr + lane * out_stride_b + q_heads[:, None] * out_stride_h + dims[None, :],
             (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=(rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :])


SPLIT_TARGET = 256  # programs to aim for: about two a multiprocessor on an H100 or H200 (132 of them)
MAX_SPLITS = 16  # the combine reads every split's partial: more would cost it more than they save


def context_splits(lanes: int, kv_heads: int, max_tokens: int, tile: int) -> int:
    """How many programs share one lane's context: enough to fill the GPU when lanes are few, never more
    than the longest context has tiles. Depends only on shapes, so a captured graph keeps it."""
    tiles = max(1, -(-max_tokens // tile))
    return max(1, min(tiles, -(-SPLIT_TARGET // (lanes * kv_heads)), MAX_SPLITS))


_arrivals: dict[tuple, torch.Tensor] = {}  # (use, device, stream) -> zeroed arrival counters, for uncaptured launches
_owner: contextvars.ContextVar[dict | None] = contextvars.ContextVar("arrival_owner", default=None)


@contextlib.contextmanager
def arrival_scope(counters: dict):
    """Launches inside take their arrival counters from `counters` (a captured graph's own, kept by whoever
    captures it) instead of the per-stream ones of uncaptured launches."""
    token = _owner.set(counters)
    try:
        yield
    finally:
        _owner.reset(token)


def arrival_counts(device: torch.device, count: int, use: str = "attention") -> torch.Tensor:
    """Zeroed int32 counters for kernels whose last program to arrive finishes the work and zeroes its
    counter again, so launches in stream order share them; made once a stream and use, or once a graph
    inside `arrival_scope` (the warm-up runs precede a capture). `use` keeps kernels out of each other's slots."""
    owned = _owner.get()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" and owned is None else 0
    table, key = (_arrivals, (use, device, stream)) if owned is None else (owned, (use, device))
    if key not in table or table[key].numel() < count:
        table[key] = torch.zeros(max(count, SPLIT_TARGET), dtype=torch.int32, device=device)
    return table[key]


def paged_decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, scale: float, block_size: int, out: torch.Tensor | None = None,
                           tile: int = 64, splits: int | None = None, table_rows: torch.Tensor | None = None,
                           fused: bool = True, k_exp: torch.Tensor | None = None,
                           v_exp: torch.Tensor | None = None) -> torch.Tensor:
    """Each query row over its whole context, read through its block table.

    q: [B, Hq, D] (rows may be strided); cache_k, cache_v: [S, Hkv, D]; tables: [B, max_blocks] int32;
    lens: [B] int32 context lengths (the new row included) -> [B, Hq, D]. `table_rows` [B]: the row of
    `tables` each query row reads (rows of one lane's prompt share it); by default its own. With few lanes
    the context is split over several programs (`context_splits`) whose partial softmaxes are combined:
    with `fused` by the split that finishes last, else by a second kernel. An fp8 cache (float8_e4m3fn)
    comes with `k_exp`, `v_exp` [S, Hkv] int8, its exponents.
    """
    lanes, hq, d = q.shape
    hkv = cache_k.shape[1]
    group = hq // hkv
    out = torch.empty(lanes, hq, d, device=q.device, dtype=q.dtype) if out is None else out
    tile = max(block_size, tile, 16)
    max_tokens = tables.shape[1] * block_size
    splits = context_splits(lanes, hkv, max_tokens, tile) if splits is None else splits
    group_pad, block_d = max(triton.next_power_of_2(group), 16), max(triton.next_power_of_2(d), 16)  # tensor-core tiles are at least 16 rows
    parts = lanes * hkv * splits if splits > 1 else 0
    part_acc = torch.empty(parts, group_pad, block_d, device=q.device, dtype=torch.float32)
    part_stats = torch.empty(parts, 2, group_pad, device=q.device, dtype=torch.float32)
    fused = fused and splits > 1
    arrivals = arrival_counts(q.device, lanes * hkv) if fused else lens
    fp8 = k_exp is not None
    _paged_decode_kernel[(lanes, hkv, splits)](
        q, cache_k, cache_v, k_exp if fp8 else lens, v_exp if fp8 else lens, out, part_acc, part_stats, arrivals, tables,
        table_rows if table_rows is not None else lens, lens, scale,
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), k_exp.stride(0) if fp8 else 0, out.stride(0),
        out.stride(1), tables.stride(0),
        # float32 models get exact float32 products; so does the interpreter, which has no bf16 matmul.
        MAX_TOKENS=max_tokens, LOOP_TO_LENGTH=not INTERPRETED, IEEE=q.dtype == torch.float32 or INTERPRETED,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE=tile, SPLITS=splits,
        TABLE_ROWS=table_rows is not None, FUSED=fused, SPLITS_PAD=triton.next_power_of_2(splits), FP8=fp8,
    )
    if splits > 1 and not fused:
        _combine_splits_kernel[(lanes, hkv)](part_acc, part_stats, out, out.stride(0), out.stride(1),
                                             GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_D=block_d, SPLITS=splits,
                                             SPLITS_PAD=triton.next_power_of_2(splits))
    return out
