"""The device memory behind the block pool: every layer's K and V for every block's tokens, in the model's
dtype or as fp8 (e4m3 values and each token's head's power-of-two exponent, `lanes.gpu.fp8`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import FP8

KV_CACHES = ("auto", "fp8")  # --kv-cache: the model's dtype, or fp8 e4m3 with an exponent a token's head


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int  # this rank's KV heads
    head_dim: int
    block_size: int

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        """Device bytes of one block with values of `dtype`; an fp8 cache adds one exponent byte a head."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_head = self.head_dim * itemsize + (1 if dtype == FP8 else 0)
        return 2 * self.layers * self.block_size * self.kv_heads * per_head


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache: k, v [slots, kv_heads, head_dim]; with fp8, k_exp, v_exp [slots, kv_heads] int8
    (a value times 2^exp is the key or value), else None."""

    k: torch.Tensor
    v: torch.Tensor
    k_exp: torch.Tensor | None = None
    v_exp: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.k_exp is not None


class KVCache:
    """K and V for `blocks` blocks: `data` is [layers, 2, (blocks + 1) * block_size, kv_heads, head_dim];
    with `fp8`, float8_e4m3fn beside `exponents` [layers, 2, slots, kv_heads] int8, else in `dtype`.

    A token's slot is `block * block_size + offset`; block ids are the pool's. Written only by passes,
    in the order the lane core runs them. One more block, `scratch_block`, is outside the pool: the padding
    rows of a captured decode graph write there, so they can never touch a lane's KV.
    """

    def __init__(self, shape: KVShape, blocks: int, *, device: torch.device, dtype: torch.dtype, fp8: bool = False) -> None:
        self.shape = shape
        self.blocks = blocks
        self.scratch_block = blocks
        self.model_dtype = dtype  # what attention computes in, whatever the cache stores
        slots = (blocks + 1) * shape.block_size
        dims = (shape.layers, 2, slots, shape.kv_heads, shape.head_dim)
        # fp8 zeroed as bytes (zero bytes are +0.0 in e4m3): filling fp8 itself is not on every device
        self.data = (torch.zeros(dims, device=device, dtype=torch.uint8).view(FP8) if fp8
                     else torch.zeros(dims, device=device, dtype=dtype))
        self.exponents = (torch.zeros(shape.layers, 2, slots, shape.kv_heads, device=device, dtype=torch.int8)
                          if fp8 else None)

    @property
    def fp8(self) -> bool:
        return self.exponents is not None

    @property
    def bytes_per_block(self) -> int:
        return self.shape.bytes_per_block(self.data.dtype)

    def layer(self, index: int) -> LayerKV:
        """This layer's K and V (and their exponents with fp8)."""
        if self.exponents is None:
            return LayerKV(self.data[index, 0], self.data[index, 1])
        return LayerKV(self.data[index, 0], self.data[index, 1], self.exponents[index, 0], self.exponents[index, 1])

    def describe(self) -> dict:
        """What /v1/info reports of the cache."""
        return {"dtype": str(self.data.dtype).removeprefix("torch."),
                "scale": "a power of two for each token's head" if self.fp8 else None,
                "bytes_per_block": self.bytes_per_block, "bytes": self.bytes_per_block * self.blocks}
