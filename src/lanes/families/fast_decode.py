"""The fast step: decode rows (and short prompts' rows), static shapes for CUDA graphs.

Each layer's parts run their `fast` halves, the same parts `Decoder.forward` runs eagerly, with Triton
kernels where the kernel is the implementation: residual add fused into RMSNorm, RoPE fused with the KV
write, SiLU fused with the product, paged attention reading block tables (nine launches a dense layer);
one row alone runs Triton GEMVs with the norms and SiLU fused in (six).
"""

from __future__ import annotations

import torch

from ..gpu import kernels
from .attention import StepRows
from .decoder import Decoder


def decode_step(decoder: Decoder, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                lens: torch.Tensor, tables: torch.Tensor, table_rows: torch.Tensor | None = None,
                logit_rows: torch.Tensor | None = None, fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """tokens, positions, slots, lens: [B] int64 (a row's context is its `lens` first positions, its own
    included: rows of one prompt see each other causally); tables: [L, width] int64, row i's table row
    `table_rows[i]` (default i) -> logits [B, vocab], or [R, vocab] for the rows `logit_rows` [R] picks.
    `fed`: (feed [B], drawn [N]): a row whose feed is not negative takes its token from `drawn`."""
    config, w = decoder.config, decoder.weights
    eps = config.rms_eps
    if fed is not None and decoder.shard.world == 1 and isinstance(w.embed, torch.Tensor) and w.embed.is_contiguous():
        x = kernels.fed_embedding(tokens, fed[0], fed[1], w.embed)  # [B, hidden]: the token's pick fused in
    else:
        if fed is not None:
            tokens = torch.where(fed[0] >= 0, fed[1].index_select(0, fed[0].clamp(min=0)), tokens)
        x = decoder.embed(tokens)  # [B, hidden]
    rows = StepRows(positions, slots, lens, tables, table_rows, decoder.inv_freq, decoder.rope_scale,
                    decoder.kv.shape.block_size)
    residual = None
    # One row (one stream decoding): Triton GEMVs with the norms and SiLU fused in, three launches a layer
    # fewer and the projections ~30% faster than cuBLAS's tiles (bench/gemv.py). A shape, so graph-safe.
    one = x.shape[0] == 1 and (logit_rows is None or logit_rows.shape[0] == 1) and decoder.one_row_ready
    for layer in w.layers:
        x, residual = layer.attention.fast(x, residual, layer.input_norm, rows, decoder.kv, one)
        x, residual = layer.ffn.fast(x, residual, layer.post_norm, one)
    if one:  # a one-row pass's logit row, if asked for, is row 0
        return w.head.norm_gemv(x, residual, w.norm, eps)[0]
    h, _ = kernels.add_rms_norm(x, residual, w.norm, eps, rows=logit_rows)
    local = w.head(h)
    if decoder.shard.world == 1:
        return local
    return decoder.comm.all_gather(local, dim=-1)[:, : config.vocab_size]
