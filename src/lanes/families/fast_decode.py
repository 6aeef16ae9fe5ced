"""The fast step: decode rows (and short prompts' rows), static shapes for CUDA graphs.

Same math as `Decoder.forward` for decode rows and causal prompt rows, with Triton kernels: residual add
fused into RMSNorm, RoPE fused with the KV write, SiLU fused with the product, paged attention reading
block tables (nine launches a layer); one row alone runs Triton GEMVs with the norms and SiLU fused in
(six).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gpu import gemv, kernels
from .decoder import Decoder, rms_norm


def decode_step(decoder: Decoder, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                lens: torch.Tensor, tables: torch.Tensor, table_rows: torch.Tensor | None = None,
                logit_rows: torch.Tensor | None = None, fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """tokens, positions, slots, lens: [B] int64 (a row's context is its `lens` first positions, its own
    included: rows of one prompt see each other causally); tables: [L, width] int64, row i's table row
    `table_rows[i]` (default i) -> logits [B, vocab], or [R, vocab] for the rows `logit_rows` [R] picks.
    `fed`: (feed [B], drawn [N]): a row whose feed is not negative takes its token from `drawn`."""
    config, w = decoder.config, decoder.weights
    d, hq, hkv, eps = config.head_dim, decoder.heads, decoder.kv_heads, config.rms_eps
    block_size = decoder.kv.shape.block_size
    if fed is not None and decoder.shard.world == 1 and w.embed.is_contiguous():
        x = kernels.fed_embedding(tokens, fed[0], fed[1], w.embed)  # [B, hidden]: the token's pick fused in
    else:
        if fed is not None:
            tokens = torch.where(fed[0] >= 0, fed[1].index_select(0, fed[0].clamp(min=0)), tokens)
        x = decoder.embed(tokens)  # [B, hidden]
    residual = None
    # One row (one stream decoding): Triton GEMVs with the norms and SiLU fused in, three launches a layer
    # fewer and the projections ~30% faster than cuBLAS's tiles (bench/gemv.py). A shape, so graph-safe.
    one = x.shape[0] == 1 and (logit_rows is None or logit_rows.shape[0] == 1) and _gemv_ready(decoder)
    for index, layer in enumerate(w.layers):
        if one:
            qkv, residual = gemv.norm_gemv(x, residual, layer.input_norm, eps, layer.qkv, layer.qkv_bias)
        else:
            h, residual = kernels.add_rms_norm(x, residual, layer.input_norm, eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [B, (hq + 2 hkv) * D]
        if layer.q_norm is not None:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            b = qkv.shape[0]
            q = rms_norm(q.reshape(b, hq, d), layer.q_norm, eps).reshape(b, hq * d)
            k = rms_norm(k.reshape(b, hkv, d), layer.k_norm, eps).reshape(b, hkv * d)
            qkv = torch.cat([q, k, v], dim=-1)
        cache_k, cache_v = decoder.kv.layer(index)
        q = kernels.rope_write_kv(qkv, positions, slots, decoder.inv_freq, decoder.rope_scale, cache_k, cache_v, hq, hkv, d)
        attended = kernels.paged_decode_attention(q, cache_k, cache_v, tables, lens, decoder.scale, block_size,
                                                  table_rows=table_rows)
        if one:
            x = gemv.gemv(attended.reshape(1, hq * d), layer.o, layer.o_bias)
            act, residual = gemv.norm_gate_up_silu(x, residual, layer.post_norm, eps, layer.gate_up, layer.gate_up_bias)
            x = gemv.gemv(act, layer.down, layer.down_bias)
            continue
        x = decoder.row_parallel(attended.reshape(-1, hq * d), layer.o, layer.o_bias)
        h, residual = kernels.add_rms_norm(x, residual, layer.post_norm, eps)
        gate_up = F.linear(h, layer.gate_up, layer.gate_up_bias)
        x = decoder.row_parallel(kernels.silu_mul(gate_up), layer.down, layer.down_bias)
    if one:  # a one-row pass's logit row, if asked for, is row 0
        return gemv.norm_gemv(x, residual, w.norm, eps, w.head)[0]
    h, _ = kernels.add_rms_norm(x, residual, w.norm, eps, rows=logit_rows)
    local = F.linear(h, w.head)
    if decoder.shard.world == 1:
        return local
    return decoder.comm.all_gather(local, dim=-1)[:, : config.vocab_size]


def _gemv_ready(decoder: Decoder) -> bool:
    """One rank, and every projection row-major (the GEMVs read weights by rows); checked once."""
    ready = getattr(decoder, "_gemv_ready", None)
    if ready is None:
        w = decoder.weights
        weights = [w.head] + [t for layer in w.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        ready = decoder.shard.world == 1 and all(t.is_contiguous() for t in weights)
        decoder._gemv_ready = ready
    return ready
