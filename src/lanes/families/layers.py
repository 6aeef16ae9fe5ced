"""A decoder as parts: each layer an attention part and a feed-forward part (a gated MLP, or a routed MoE
block) between two RMSNorms, and the model's embedding, final norm and head; read for one shard."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.source import TensorSource
from ..gpu.collective import Collective, Solo
from ..progress import Progress
from ..quant import DenseWeight, Weight
from .attention import Attention
from .config import ModelConfig
from .linear import Linear
from .mlp import GatedMLP
from .moe import MoE
from .names import ATTENTION, INPUT_NORM, MLP, POST_NORM, MoENames
from .weights import Reader, Shard


@dataclass
class Layer:
    input_norm: torch.Tensor  # [hidden]
    attention: Attention
    post_norm: torch.Tensor  # [hidden]
    ffn: GatedMLP | MoE


@dataclass
class DecoderWeights:
    embed: torch.Tensor | Weight  # [vocab_per_rank, hidden]: looked up (a Weight's `take`), never multiplied
    layers: list[Layer]
    norm: torch.Tensor  # [hidden]
    head: Linear  # [vocab_per_rank, hidden]; the embedding itself when tied
    embed_read: Weight | None = None  # the embedding as read, when `embed` is its tensor (what it was read from)


def tensor_count(config: ModelConfig) -> int:
    """How many tensors `load_decoder` reads (for the progress bar; an MoE layer's experts count one a matrix)."""
    total = 2 + (not config.tie_embeddings)
    for i in range(config.layers):
        sparse = config.moe is not None and config.moe.sparse(i)
        total += 2 + Attention.tensors(config) + (MoE.tensors(config.moe) if sparse else GatedMLP.tensors(config.mlp_bias))
    return total


def load_decoder(
    config: ModelConfig,
    source: TensorSource,
    path: Path,
    *,
    shard: Shard,
    device: torch.device,
    dtype: torch.dtype,
    experts: MoENames | None = None,
    comm: Collective | None = None,
    progress: Progress | None = None,
    quantize: str | None = None,
    keep_blocks: bool = True,
) -> DecoderWeights:
    """Read every tensor this shard needs, composing each layer's parts from the config (`experts`: where
    an MoE family keeps its experts' tensors; `quantize`: "int8" or "int4" for full-precision matrices; without `keep_blocks`, a GGUF file's
    blocks are dequantized to `dtype`); missing or misshapen tensors raise CheckpointError."""
    shard.check(config)
    if config.moe is not None and experts is None:
        raise ValueError(f"the {config.family} family has experts but names none of their tensors")
    comm = comm or Solo()
    read = Reader(source, path, device, dtype, progress, quantize, keep_blocks)
    hidden = config.hidden_size
    layers = []
    for i in range(config.layers):
        prefix = f"model.layers.{i}."
        attention = Attention.load(read, prefix + ATTENTION, i, config, shard, comm)
        if config.moe is not None and config.moe.sparse(i):
            ffn: GatedMLP | MoE = MoE.load(read, prefix, experts, config, shard, comm)
        else:
            ffn = GatedMLP.load(read, prefix + MLP, hidden, config.intermediate_size, config.mlp_bias, shard, comm,
                                config.rms_eps)
        layers.append(Layer(read.get(prefix + INPUT_NORM, (hidden,)), attention, read.get(prefix + POST_NORM, (hidden,)), ffn))
    embed = read.vocab("model.embed_tokens.weight", config, shard)
    head = Linear(embed if config.tie_embeddings else read.vocab("lm_head.weight", config, shard))  # tied: one weight
    table = embed.tensor if isinstance(embed, DenseWeight) else embed
    return DecoderWeights(embed=table, layers=layers, norm=read.get("model.norm.weight", (hidden,)), head=head,
                          embed_read=embed)
