"""The forward pass of a decoder over the paged KV cache, for one shard: its layers' parts in turn.

Every lane's rows of a pass run flat ([T, hidden]) through the parts; attention regroups them per lane
over the block pool. Where ranks would disagree the collective sums (inside the parts, after row-parallel
products; after the vocabulary-parallel embedding) or gathers (the head's vocabulary slices).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..core.passes import Piece
from ..gpu.attention import PagedRows, RowSpan
from ..gpu.collective import Collective
from ..gpu.kv import KVCache
from .config import ModelConfig
from .layers import DecoderWeights
from .mrope import mrope_cos_sin
from .norm import rms_norm
from .rope import cos_sin, inverse_frequencies
from .weights import Shard


class PassMedia:
    """What a pass with image or video rows adds: M-RoPE positions [3, T] for all its rows, and the
    embeddings [K, hidden] that replace the token embeddings of rows `rows` [K] (the vision tower's)."""

    def __init__(self, positions: np.ndarray, rows: np.ndarray, embeds: torch.Tensor) -> None:
        self.positions, self.rows, self.embeds = positions, rows, embeds


class PassInputs:
    """A pass's host-built inputs, on the device: token ids, positions, attention indices, logit rows."""

    def __init__(self, pieces: Sequence[Piece], block_size: int, device: torch.device, media: PassMedia | None = None) -> None:
        tokens = np.fromiter((t for p in pieces for t in p.tokens), np.int64)
        positions = np.concatenate([np.arange(p.start, p.end, dtype=np.int64) for p in pieces])
        rows, offset = [], 0
        for p in pieces:
            n = len(p.tokens)
            if p.logits == "all":
                rows.append(np.arange(offset, offset + n))
            elif p.logits == "last":
                rows.append(np.array([offset + n - 1]))
            offset += n
        self.tokens = torch.from_numpy(tokens).to(device, non_blocking=True)  # [T]
        self.positions = torch.from_numpy(positions).to(device, non_blocking=True)  # [T]
        picked = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        self.logit_rows = torch.from_numpy(picked.astype(np.int64)).to(device, non_blocking=True)  # [R]
        spans = [RowSpan(p.start, len(p.tokens), p.blocks) for p in pieces]
        self.paged = PagedRows(spans, block_size, device)
        self.media_positions = self.media_rows = self.media_embeds = None
        if media is not None:
            self.media_positions = torch.from_numpy(media.positions).to(device, non_blocking=True)  # [3, T]
            self.media_rows = torch.from_numpy(media.rows).to(device, non_blocking=True)  # [K]
            self.media_embeds = media.embeds  # [K, hidden], on the device


class Decoder:
    """One shard of a decoder with its KV cache; `forward` runs a pass and returns the asked-for logits."""

    def __init__(self, config: ModelConfig, weights: DecoderWeights, kv: KVCache, comm: Collective, shard: Shard) -> None:
        self.config = config
        self.weights = weights
        self.kv = kv
        self.comm = comm
        self.shard = shard
        self.device = weights.norm.device
        self.dtype = weights.norm.dtype
        self.vocab_first, self.vocab_per_rank = shard.vocab_range(config.vocab_size)
        inv_freq, self.rope_scale = inverse_frequencies(config)
        self.inv_freq = inv_freq.to(self.device)  # [rotary_dim / 2] float32
        parts = [p for layer in weights.layers for p in (layer.attention, layer.ffn)]
        # The one-row GEMVs need one rank and weights they can read by rows; checked once.
        self.one_row_ready = shard.world == 1 and weights.head.one_row_ready() and all(p.one_row_ready() for p in parts)
        self.graph_safe = all(layer.ffn.graph_safe for layer in weights.layers)  # whether a CUDA graph may hold a step

    @torch.inference_mode()
    def forward(self, pieces: Sequence[Piece], media: PassMedia | None = None) -> torch.Tensor:
        """Run one pass; returns logits [R, vocab] in the model dtype for the pieces' logit rows, in order."""
        inputs = PassInputs(pieces, self.kv.shape.block_size, self.device, media)
        return self.forward_inputs(inputs)

    @torch.inference_mode()
    def decode_step(self, tokens, positions, slots, lens, tables, table_rows=None, logit_rows=None, fed=None) -> torch.Tensor:
        """The fast decode step (Triton kernels, static shapes): see `fast_decode.decode_step`."""
        from .fast_decode import decode_step

        return decode_step(self, tokens, positions, slots, lens, tables, table_rows, logit_rows, fed)

    def forward_inputs(self, inputs: PassInputs) -> torch.Tensor:
        x = self.embed(inputs.tokens)  # [T, hidden]
        if inputs.media_positions is None:
            cos, sin = cos_sin(self.inv_freq, self.rope_scale, inputs.positions, self.dtype)  # [T, rotary_dim]
        else:
            cos, sin = mrope_cos_sin(self.inv_freq, self.rope_scale, inputs.media_positions, self.config.mrope_section, self.dtype)
            x = x.index_copy(0, inputs.media_rows, inputs.media_embeds.to(x.dtype))
        eps = self.config.rms_eps
        for layer in self.weights.layers:
            x = x + layer.attention(rms_norm(x, layer.input_norm, eps), cos, sin, inputs.paged, self.kv)
            x = x + layer.ffn(rms_norm(x, layer.post_norm, eps))
        return self.logits(x.index_select(0, inputs.logit_rows))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank fills the rows its slice holds, the sum fills the rest."""
        if self.shard.world == 1:
            return self._lookup(tokens)
        local = tokens - self.vocab_first
        inside = (local >= 0) & (local < self.vocab_per_rank)
        rows = self._lookup(local.clamp(0, self.vocab_per_rank - 1))
        return self.comm.all_reduce(rows * inside[:, None].to(rows.dtype))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.weights.embed
        return F.embedding(ids, table) if isinstance(table, torch.Tensor) else table.take(ids, self.dtype)

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, vocab]: the final norm, this rank's vocabulary slice, then the gather."""
        local = self.weights.head(rms_norm(rows, self.weights.norm, self.config.rms_eps))
        if self.shard.world == 1:
            return local
        return self.comm.all_gather(local, dim=-1)[:, : self.config.vocab_size]
