"""The attention part: one layer's self-attention on this rank, over the paged KV cache.

Variants the families need are its fields, not subclasses: a bias on q/k/v and on o, an RMSNorm on each
head of q and k (Qwen3), RoPE over only the first dimensions of each head (GLM-4.5), and grouped KV heads
(split across ranks, or replicated where there are fewer than ranks). `forward` is the eager path;
`fast` is the same layer in the graphed step, where the rotation with the KV write and the attention
over block tables are Triton kernels and the input norm is fused into the first product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gpu.attention import PagedRows, paged_attention, rope_attention, write_kv
from ..gpu.collective import Collective
from ..gpu.kv import KVCache
from .config import ModelConfig
from ..quant import stack_rows
from .linear import Linear, RowParallel
from .norm import rms_norm
from .rope import apply_rotary
from .weights import Reader, Shard


@dataclass(frozen=True)
class StepRows:
    """What the graphed step's attention reads besides x: positions, slots, lens: [B] int64 (a row's
    context is its `lens` first positions); tables: [L, width] int64, row i's table row `table_rows[i]`
    (None: row i); the rotary frequencies [rotary_dim / 2] float32 and the scale on cos and sin."""

    positions: torch.Tensor
    slots: torch.Tensor
    lens: torch.Tensor
    tables: torch.Tensor
    table_rows: torch.Tensor | None
    inv_freq: torch.Tensor
    rope_scale: float
    block_size: int


class Attention:
    """Layer `index`'s attention: qkv [(hq + 2 hkv) * D, hidden] column-parallel by heads (this rank's),
    q/k norms [D] or None, o row-parallel over this rank's heads."""

    def __init__(self, index: int, qkv: Linear, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                 o: RowParallel, heads: int, kv_heads: int, head_dim: int, rotary_dim: int, eps: float) -> None:
        self.index, self.qkv, self.q_norm, self.k_norm, self.o = index, qkv, q_norm, k_norm, o
        self.heads, self.kv_heads, self.head_dim, self.rotary_dim, self.eps = heads, kv_heads, head_dim, rotary_dim, eps
        self.scale = head_dim**-0.5

    @staticmethod
    def tensors(config: ModelConfig) -> int:
        """How many tensors `load` reads."""
        return 4 + 3 * config.qkv_bias + config.o_bias + 2 * config.qk_norm

    @classmethod
    def load(cls, read: Reader, prefix: str, index: int, config: ModelConfig, shard: Shard,
             comm: Collective) -> "Attention":
        """`prefix` ends in "self_attn."; q/k/v read as q_proj, k_proj, v_proj (weight, and bias where the
        config has one), o as o_proj."""
        hidden, d = config.hidden_size, config.head_dim
        q_rows, kv_rows = config.heads * d, config.kv_heads * d

        def qkv(kind: str, tail: tuple[int, ...]):
            read_one = read.weight if kind == "weight" else read.get
            q = read_one(prefix + f"q_proj.{kind}", (q_rows, *tail), dim=0, part=shard.column)
            k = read_one(prefix + f"k_proj.{kind}", (kv_rows, *tail), dim=0, part=shard.kv_part(config))
            v = read_one(prefix + f"v_proj.{kind}", (kv_rows, *tail), dim=0, part=shard.kv_part(config))
            return stack_rows([q, k, v]) if kind == "weight" else torch.cat([q, k, v]).contiguous()

        fused = Linear(qkv("weight", (hidden,)), qkv("bias", ()) if config.qkv_bias else None)
        q_norm = read.get(prefix + "q_norm.weight", (d,)) if config.qk_norm else None
        k_norm = read.get(prefix + "k_norm.weight", (d,)) if config.qk_norm else None
        o = RowParallel(read.weight(prefix + "o_proj.weight", (hidden, q_rows), dim=1, part=shard.column),
                        read.get(prefix + "o_proj.bias", (hidden,)) if config.o_bias else None, comm)
        return cls(index, fused, q_norm, k_norm, o, config.heads // shard.world, shard.kv_heads(config), d,
                   config.rotary_dim, config.rms_eps)

    def one_row_ready(self) -> bool:
        return self.qkv.one_row_ready() and self.o.linear.one_row_ready()

    def heads_of(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (hq + 2 hkv) * D] -> q [T, hq, D], k and v [T, hkv, D], q and k normed where the family norms them."""
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = q.view(t, self.heads, d), k.view(t, self.kv_heads, d), v.reshape(t, self.kv_heads, d)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        return q, k, v

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, paged: PagedRows,
                kv: KVCache) -> torch.Tensor:
        """h: [T, hidden] (normed); cos, sin: [T, rotary_dim] -> [T, hidden], summed across ranks. Writes
        the rows' K and V into their slots first."""
        qkv = self.qkv(h)
        cache = kv.layer(self.index)
        if self.q_norm is None and not cache.fp8:
            out = rope_attention(qkv, cos, sin, cache.k, cache.v, paged, self.heads, self.scale)
            if out is not None:
                return self.o(out)
        if self.q_norm is None:  # q and k side by side in qkv's rows: rotated as one tensor of heads
            t, d = qkv.shape[0], self.head_dim
            qk, v = qkv.split([(self.heads + self.kv_heads) * d, self.kv_heads * d], dim=-1)
            q, k = apply_rotary(qk.reshape(t, self.heads + self.kv_heads, d), cos, sin).split([self.heads, self.kv_heads], dim=1)
            v = v.reshape(t, self.kv_heads, d)
        else:
            q, k, v = self.heads_of(qkv)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        exponents = (cache.k_exp, cache.v_exp) if cache.fp8 else None
        write_kv(cache.k, cache.v, paged, k, v, exponents)
        out = paged_attention(q, cache.k, cache.v, paged, self.scale, exponents)  # [T, hq, D]
        return self.o(out.reshape(h.shape[0], self.heads * self.head_dim))

    __call__ = forward

    def fast(self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor, rows: StepRows,
             kv: KVCache, one: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphed step's attention: x, residual [B, hidden] (residual None before the first layer) ->
        (attention output [B, hidden], x + residual). `one`: a one-row pass on one rank (the fused GEMVs)."""
        from ..gpu import kernels

        if one:
            qkv, residual = self.qkv.norm_gemv(x, residual, norm, self.eps)
        else:
            h, residual = kernels.add_rms_norm(x, residual, norm, self.eps)
            qkv = self.qkv(h)  # [B, (hq + 2 hkv) * D]
        if self.q_norm is not None:  # the kernel below reads q, k and v from one row-major tensor
            b = qkv.shape[0]
            q, k, v = self.heads_of(qkv)
            qkv = torch.cat([q.reshape(b, -1), k.reshape(b, -1), v.reshape(b, -1)], dim=-1)
        cache = kv.layer(self.index)
        q = kernels.rope_write_kv(qkv, rows.positions, rows.slots, rows.inv_freq, rows.rope_scale, cache.k, cache.v,
                                  self.heads, self.kv_heads, self.head_dim, rotary_dim=self.rotary_dim,
                                  k_exp=cache.k_exp, v_exp=cache.v_exp)
        attended = kernels.paged_decode_attention(q, cache.k, cache.v, rows.tables, rows.lens, self.scale, rows.block_size,
                                                  table_rows=rows.table_rows, k_exp=cache.k_exp, v_exp=cache.v_exp)
        flat = attended.reshape(-1, self.heads * self.head_dim)
        return (self.o.linear.gemv(flat) if one else self.o(flat)), residual
