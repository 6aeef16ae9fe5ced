"""A GGUF file's tensors under Hugging Face names (its metadata as a config.json is `gguf_config`).

Matrices in a block format with a CPU kernel are kept as the file's bytes (`weight`, lanes.quant); other
tensors are dequantized one at a time with the gguf package (`get`). The family gives the names: llama.cpp's
name of each layer tensor after `blk.N.` to its Hugging Face name after `model.layers.N.` (an MoE
family's experts stay stacked, [experts, rows, cols], under their expert name without the expert's
number). llama.cpp stores the Q and K rows of the `llama` architecture permuted for its interleaved RoPE,
and Qwen2-MoE's shared-expert gate as a vector; reading undoes both.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np
import torch

from ..quant import Weight, block_format, from_gguf
from .gguf_file import GGUFFile

PERMUTED = {"llama"}  # convert_hf_to_gguf permutes q/k only for these
SHARED_GATE = "ffn_gate_inp_shexp.weight"  # [hidden] in the file, [1, hidden] in Hugging Face checkpoints

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str, layer_names: Mapping[str, str]) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors the family does not read."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _BLOCK.match(gguf_name)
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
    return None


class GGUFSource:
    """The tensors of a GGUF file under Hugging Face names, dequantized to float32 one at a time."""

    def __init__(self, file: GGUFFile, config: dict[str, Any], layer_names: Mapping[str, str]) -> None:
        self.file = file
        self.path = file.path
        self._gguf_name = {hf: g for g in file.tensors if (hf := hf_name(g, layer_names)) is not None}
        self._permute = file.architecture in PERMUTED
        self._heads = int(config["num_attention_heads"])
        self._kv_heads = int(config["num_key_value_heads"])

    def names(self) -> list[str]:
        return list(self._gguf_name)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self.file.shape(self._gguf_name[name])
        return (1, *shape) if self._gguf_name[name].endswith(SHARED_GATE) and len(shape) == 1 else shape

    def get(self, name: str, *, dim: int | None = None, rank: int = 0, world: int = 1) -> torch.Tensor:
        array = self.file.dequantize(self._gguf_name[name])
        # F32 tensors come back as read-only views of the mapped file; torch needs memory it may own.
        tensor = torch.from_numpy(array if array.flags.writeable and array.flags.c_contiguous else array.copy())
        tensor = tensor.reshape(self.shape(name))
        if self._permute and ".self_attn.q_proj." in name:
            tensor = unpermute(tensor, self._heads)
        elif self._permute and ".self_attn.k_proj." in name:
            tensor = unpermute(tensor, self._kv_heads)
        if dim is None or world == 1:
            return tensor
        return tensor.chunk(world, dim=dim)[rank].contiguous()


    def weight(self, name: str, *, dim: int | None = None, rank: int = 0, world: int = 1, dtype: torch.dtype,
               device: torch.device, keep: bool = True) -> Weight | None:
        """A matrix as `lanes.quant.from_gguf` builds it from the file's bytes, this rank's part of it (rows
        moved as bytes: the Q/K permutation undone by `rows`, column slices cut at block edges); None where
        `get` must read it (not a matrix, or a column slice inside a block)."""
        gguf_name = self._gguf_name[name]
        tensor = self.file.tensors[gguf_name]
        shape = self.file.shape(gguf_name)
        if len(shape) != 2:
            return None
        rows, columns = shape
        data = tensor.data
        if dim == 1 and world > 1:
            step = columns // world
            fmt = block_format(tensor.tensor_type)
            if fmt is not None:
                if step % fmt.values:
                    return None
                width = fmt.row_bytes(step)
                data = np.asarray(data).view(np.uint8).reshape(rows, -1)[:, rank * width : (rank + 1) * width]
            elif data.ndim == 2 and data.shape[1] == columns:  # F32/F16/BF16: values, not blocks
                data = data[:, rank * step : (rank + 1) * step]
            else:
                return None
            columns = step
        weight = from_gguf(data, tensor.tensor_type, (rows, columns), dtype, device=device, keep=keep)
        index = torch.arange(rows)
        if self._permute and ".self_attn.q_proj." in name:
            index = unpermute(index, self._heads)
        elif self._permute and ".self_attn.k_proj." in name:
            index = unpermute(index, self._kv_heads)
        if dim == 0 and world > 1:
            index = index.chunk(world)[rank]
        if dim == 0 and world > 1 or not torch.equal(index, torch.arange(rows)):
            weight = weight.rows(index.to(device))
        return weight


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`: each head's rows go from interleaved pairs back to two halves."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
