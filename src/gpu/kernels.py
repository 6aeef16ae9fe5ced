"""Triton kernels of the decode path: paged attention over the block pool, and the fusions that cut a
layer's launches from ~35 to 9 (residual add with RMSNorm, RoPE with the KV write, SiLU with the product).

Imported only where Triton is (the CUDA path; tests run them on the CPU under TRITON_INTERPRET=1). Each
kernel computes in float32 and rounds where the eager path rounds, so greedy tokens agree with it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, tables_ptr, table, kv_head, start, length, scale, best, total, acc,
                 kv_stride_s, kv_stride_h, tables_stride, dims, dim_ok, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                 IEEE: tl.constexpr):
    """One tile of a lane's context on the tensor cores: scores, the online softmax, the weighted values."""
    positions = start + tl.arange(0, TILE)
    valid = positions < length
    blocks = tl.load(tables_ptr + table * tables_stride + positions // BLOCK_SIZE, mask=valid, other=0)
    slots = blocks.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    kv_mask = valid[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + slots[:, None] * kv_stride_s + kv_head * kv_stride_h + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slots[:, None] * kv_stride_s + kv_head * kv_stride_h + dims[None, :], mask=kv_mask, other=0.0)
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
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_stats_ptr, arrivals_ptr, tables_ptr, table_rows_ptr,
                         lens_ptr, scale,
                         q_stride_b, q_stride_h, kv_stride_s, kv_stride_h, out_stride_b, out_stride_h, tables_stride,
                         MAX_TOKENS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr,
                         LOOP_TO_LENGTH: tl.constexpr, IEEE: tl.constexpr, TABLE_ROWS: tl.constexpr,
                         FUSED: tl.constexpr, SPLITS_PAD: tl.constexpr):
    lane = tl.program_id(0)  # a query row; its table row is its own, or (prompt rows of one lane) a shared one
    kv_head = tl.program_id(1)
    split = tl.program_id(2)  # this program's share of the context: tiles split, split + SPLITS, ...
    rows = tl.arange(0, GROUP_PAD)  # the query heads that share this KV head
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + lane * q_stride_b + q_heads[:, None] * q_stride_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [GROUP_PAD, BLOCK_D], the cache's dtype
    length = tl.load(lens_ptr + lane)
    table = tl.load(table_rows_ptr + lane) if TABLE_ROWS else lane
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    # On a GPU the loop stops at the lane's length (read on the device, so a captured graph stays right);
    # Triton's interpreter cannot bound a loop by a loaded value, so there it runs to the table's end.
    if LOOP_TO_LENGTH:
        for start in range(split * TILE, length, SPLITS * TILE):
            best, total, acc = _attend_tile(q, k_ptr, v_ptr, tables_ptr, table, kv_head, start, length, scale, best, total,
                                            acc, kv_stride_s, kv_stride_h, tables_stride, dims, dim_ok, BLOCK_SIZE, TILE,
                                            IEEE)
    else:
        for start in range(split * TILE, MAX_TOKENS, SPLITS * TILE):
            best, total, acc = _attend_tile(q, k_ptr, v_ptr, tables_ptr, table, kv_head, start, length, scale, best, total,
                                            acc, kv_stride_s, kv_stride_h, tables_stride, dims, dim_ok, BLOCK_SIZE, TILE,
                                            IEEE)
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


_arrivals: dict[tuple, torch.Tensor] = {}  # (use, device, stream) -> zeroed arrival counters


def arrival_counts(device: torch.device, count: int, use: str = "attention") -> torch.Tensor:
    """Zeroed int32 counters for kernels whose last program to arrive finishes the work and zeroes its
    counter again, so launches in stream order share them; made once a stream and use (the warm-up runs
    precede a capture). `use` keeps kernels from counting in each other's slots."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (use, device, stream)
    if key not in _arrivals or _arrivals[key].numel() < count:
        _arrivals[key] = torch.zeros(max(count, SPLIT_TARGET), dtype=torch.int32, device=device)
    return _arrivals[key]


def paged_decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, scale: float, block_size: int, out: torch.Tensor | None = None,
                           tile: int = 64, splits: int | None = None, table_rows: torch.Tensor | None = None,
                           fused: bool = True) -> torch.Tensor:
    """Each query row over its whole context, read through its block table.

    q: [B, Hq, D] (rows may be strided); cache_k, cache_v: [S, Hkv, D]; tables: [B, max_blocks] int32;
    lens: [B] int32 context lengths (the new row included) -> [B, Hq, D]. `table_rows` [B]: the row of
    `tables` each query row reads (rows of one lane's prompt share it); by default its own. With few lanes
    the context is split over several programs (`context_splits`) whose partial softmaxes are combined:
    with `fused` by the split that finishes last, else by a second kernel.
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
    _paged_decode_kernel[(lanes, hkv, splits)](
        q, cache_k, cache_v, out, part_acc, part_stats, arrivals, tables, table_rows if table_rows is not None else lens,
        lens, scale,
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        # float32 caches get exact float32 products; so does the interpreter, which has no bf16 matmul.
        MAX_TOKENS=max_tokens, LOOP_TO_LENGTH=not INTERPRETED, IEEE=cache_k.dtype == torch.float32 or INTERPRETED,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=block_size, TILE=tile, SPLITS=splits,
        TABLE_ROWS=table_rows is not None, FUSED=fused, SPLITS_PAD=triton.next_power_of_2(splits),
    )
    if splits > 1 and not fused:
        _combine_splits_kernel[(lanes, hkv)](part_acc, part_stats, out, out.stride(0), out.stride(1),
                                             GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_D=block_d, SPLITS=splits,
                                             SPLITS_PAD=triton.next_power_of_2(splits))
    return out


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
                       attention_scale, qkv_stride, q_out_stride_t, q_out_stride_h, kv_stride_s, kv_stride_h,
                       HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       PASS: tl.constexpr, PASS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr):
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
        tl.store(k_out + half, lo.to(k_cache_ptr.dtype.element_ty))
        tl.store(k_out + HALF + half, hi.to(k_cache_ptr.dtype.element_ty))
        if PASS > 0:
            tl.store(k_out + rest, tl.load(base + rest, mask=rest_ok).to(k_cache_ptr.dtype.element_ty), mask=rest_ok)
        v_in = qkv_ptr + token * qkv_stride + (HQ + HKV + kv_head) * HEAD_DIM
        v_out = v_cache_ptr + slot * kv_stride_s + kv_head * kv_stride_h
        if PASS > 0:
            dims = tl.arange(0, HEAD_PAD)
            tl.store(v_out + dims, tl.load(v_in + dims, mask=dims < HEAD_DIM), mask=dims < HEAD_DIM)
        else:
            tl.store(v_out + half, tl.load(v_in + half))
            tl.store(v_out + HALF + half, tl.load(v_in + HALF + half))


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, inv_freq: torch.Tensor,
                  attention_scale: float, cache_k: torch.Tensor, cache_v: torch.Tensor, hq: int, hkv: int,
                  head_dim: int, q_out: torch.Tensor | None = None, rotary_dim: int | None = None) -> torch.Tensor:
    """Rotate q and k by their positions; store k and v in the cache at `slots`; return the rotated q.

    qkv: [T, (hq + 2 hkv) * D] with q/k already normed where the family norms them; positions, slots: [T];
    inv_freq: [R / 2] float32 -> q: [T, hq, D]. `rotary_dim` R (default D): only each head's first R
    dimensions rotate, the rest pass through (partial rotary).
    """
    tokens = qkv.shape[0]
    rotary = head_dim if rotary_dim is None else rotary_dim
    passed = head_dim - rotary
    q_out = torch.empty(tokens, hq, head_dim, device=qkv.device, dtype=qkv.dtype) if q_out is None else q_out
    _rope_write_kernel[(tokens, hq + hkv)](
        qkv, positions, slots, inv_freq, q_out, cache_k, cache_v, attention_scale,
        qkv.stride(0), q_out.stride(0), q_out.stride(1), cache_k.stride(0), cache_k.stride(1),
        HQ=hq, HKV=hkv, HEAD_DIM=head_dim, HALF=rotary // 2, PASS=passed,
        PASS_PAD=triton.next_power_of_2(max(passed, 1)), HEAD_PAD=triton.next_power_of_2(head_dim),
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
