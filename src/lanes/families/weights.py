"""A Llama-shaped decoder's weights for one tensor-parallel shard, read tensor by tensor onto the device.

Column-parallel linears (q, k, v, gate, up) keep this rank's output rows, row-parallel ones (o, down) its
input columns; the embedding and the head keep this rank's slice of the vocabulary. q/k/v and gate/up are
fused into one matrix each, so a layer runs two matmuls where it would run five.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.errors import CheckpointError
from ..checkpoint.source import TensorSource
from ..progress import Progress
from .config import ModelConfig


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    world: int = 1

    def check(self, config: ModelConfig) -> None:
        for what, n in (("attention heads", config.heads), ("intermediate size", config.intermediate_size)):
            if n % self.world:
                raise ValueError(f"{what} ({n}) do not split over {self.world} ranks")
        if config.kv_heads % self.world and self.world % config.kv_heads:
            raise ValueError(f"{config.kv_heads} KV heads neither split over nor replicate across {self.world} ranks")

    def kv_heads(self, config: ModelConfig) -> int:
        """KV heads on this rank; fewer KV heads than ranks are replicated, one a rank."""
        return max(1, config.kv_heads // self.world)

    def kv_part(self, config: ModelConfig) -> tuple[int, int]:
        """(part, parts) of the KV projections this rank reads."""
        if config.kv_heads >= self.world:
            return self.rank, self.world
        return self.rank // (self.world // config.kv_heads), config.kv_heads

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """This rank's [first, first + per_rank) slice of the vocabulary, padded to the same size on every rank."""
        per_rank = -(-vocab // self.world)
        return self.rank * per_rank, per_rank


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(hq + 2 * hkv) * head_dim, hidden], this rank's heads
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [hidden, hq * head_dim]
    o_bias: torch.Tensor | None  # added once, after the all-reduce
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate / world, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [hidden, intermediate / world]
    down_bias: torch.Tensor | None


@dataclass
class DecoderWeights:
    embed: torch.Tensor  # [vocab_per_rank, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor
    head: torch.Tensor  # [vocab_per_rank, hidden]; the embedding itself when tied


class _Reader:
    """Reads named tensors from a source onto the device, checking shapes against the config."""

    def __init__(self, source: TensorSource, path: Path, device: torch.device, dtype: torch.dtype, progress: Progress | None):
        self.source, self.path, self.device, self.dtype, self.progress = source, path, device, dtype, progress
        self.names = set(source.names())

    def has(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str, shape: tuple[int, ...], *, dim: int | None = None, part: tuple[int, int] = (0, 1)) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(self.path, f"missing tensor {name!r}")
        stored = tuple(self.source.shape(name))
        if stored != shape:
            raise CheckpointError(self.path, f"tensor {name!r} has shape {list(stored)}, the config says {list(shape)}")
        host = self.source.get(name, dim=dim, rank=part[0], world=part[1]) if dim is not None else self.source.get(name)
        if self.progress is not None:
            self.progress.advance()
        return host.to(device=self.device, dtype=self.dtype)

    def vocab(self, name: str, config: ModelConfig, shard: Shard) -> torch.Tensor:
        """This rank's vocabulary rows, zero-padded to the per-rank size."""
        full = self.get(name, (config.vocab_size, config.hidden_size))
        first, per_rank = shard.vocab_range(config.vocab_size)
        rows = full[first : first + per_rank]
        if rows.shape[0] < per_rank:
            rows = torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], rows.shape[1])])
        return rows.contiguous()


def tensor_count(config: ModelConfig) -> int:
    """How many tensors `load_decoder` reads (for the progress bar)."""
    per_layer = 9 + 3 * config.qkv_bias + config.o_bias + 3 * config.mlp_bias + 2 * config.qk_norm
    return 2 + (not config.tie_embeddings) + per_layer * config.layers


def load_decoder(
    config: ModelConfig,
    source: TensorSource,
    path: Path,
    *,
    shard: Shard,
    device: torch.device,
    dtype: torch.dtype,
    progress: Progress | None = None,
) -> DecoderWeights:
    """Read every tensor this shard needs; missing or misshapen tensors raise CheckpointError."""
    shard.check(config)
    read = _Reader(source, path, device, dtype, progress)
    hidden, d = config.hidden_size, config.head_dim
    q_rows, kv_rows, inter = config.heads * d, config.kv_heads * d, config.intermediate_size
    column, kv_part, row = (shard.rank, shard.world), shard.kv_part(config), (shard.rank, shard.world)

    layers = []
    for i in range(config.layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."

        def qkv(kind: str, shape_tail: tuple[int, ...]) -> torch.Tensor:
            q = read.get(attn + f"q_proj.{kind}", (q_rows, *shape_tail), dim=0, part=column)
            k = read.get(attn + f"k_proj.{kind}", (kv_rows, *shape_tail), dim=0, part=kv_part)
            v = read.get(attn + f"v_proj.{kind}", (kv_rows, *shape_tail), dim=0, part=kv_part)
            return torch.cat([q, k, v]).contiguous()

        def gate_up(kind: str, shape_tail: tuple[int, ...]) -> torch.Tensor:
            gate = read.get(p + f"mlp.gate_proj.{kind}", (inter, *shape_tail), dim=0, part=column)
            up = read.get(p + f"mlp.up_proj.{kind}", (inter, *shape_tail), dim=0, part=column)
            return torch.cat([gate, up]).contiguous()

        layers.append(
            LayerWeights(
                input_norm=read.get(p + "input_layernorm.weight", (hidden,)),
                qkv=qkv("weight", (hidden,)),
                qkv_bias=qkv("bias", ()) if config.qkv_bias else None,
                q_norm=read.get(attn + "q_norm.weight", (d,)) if config.qk_norm else None,
                k_norm=read.get(attn + "k_norm.weight", (d,)) if config.qk_norm else None,
                o=read.get(attn + "o_proj.weight", (hidden, q_rows), dim=1, part=row),
                o_bias=read.get(attn + "o_proj.bias", (hidden,)) if config.o_bias else None,
                post_norm=read.get(p + "post_attention_layernorm.weight", (hidden,)),
                gate_up=gate_up("weight", (hidden,)),
                gate_up_bias=gate_up("bias", ()) if config.mlp_bias else None,
                down=read.get(p + "mlp.down_proj.weight", (hidden, inter), dim=1, part=row),
                down_bias=read.get(p + "mlp.down_proj.bias", (hidden,)) if config.mlp_bias else None,
            )
        )
    embed = read.vocab("model.embed_tokens.weight", config, shard)
    head = embed if config.tie_embeddings else read.vocab("lm_head.weight", config, shard)
    return DecoderWeights(embed=embed, layers=layers, norm=read.get("model.norm.weight", (hidden,)), head=head)
