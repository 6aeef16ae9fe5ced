"""The device memory behind the block pool: every layer's K and V for every block's tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int  # this rank's KV heads
    head_dim: int
    block_size: int

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * itemsize


class KVCache:
    """K and V for `blocks` blocks: `data` is [layers, 2, (blocks + 1) * block_size, kv_heads, head_dim].

    A token's slot is `block * block_size + offset`; block ids are the pool's. Written only by passes,
    in the order the lane core runs them. One more block, `scratch_block`, is outside the pool: the padding
    rows of a captured decode graph write there, so they can never touch a lane's KV.
    """

    def __init__(self, shape: KVShape, blocks: int, *, device: torch.device, dtype: torch.dtype) -> None:
        self.shape = shape
        self.blocks = blocks
        self.scratch_block = blocks
        slots = (blocks + 1) * shape.block_size
        self.data = torch.zeros(shape.layers, 2, slots, shape.kv_heads, shape.head_dim, device=device, dtype=dtype)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (k, v), each [slots, kv_heads, head_dim]."""
        return self.data[index, 0], self.data[index, 1]
