"""Group-wise quantization of full-precision rows into GGUF's Q8_0 and Q4_1, byte for byte as the gguf
package's reference quantizer writes them (in torch, a chunk of rows at a time)."""

from __future__ import annotations

import gguf
import torch

Q = gguf.GGMLQuantizationType
SCHEMES = {"int8": Q.Q8_0, "int4": Q.Q4_1}
CHUNK = 4096  # rows a step: bounds the fp32 temporaries to a few MiB a step


def quantize_rows(weight: torch.Tensor, kind: Q) -> torch.Tensor:
    """weight [out, in] (in a multiple of 32) -> [out, row bytes] uint8 in format `kind` (Q8_0 or Q4_1)."""
    out_features, in_features = weight.shape
    if in_features % 32:
        raise ValueError(f"{kind.name} rows are whole blocks of 32 values, not {in_features}")
    encode = {Q.Q8_0: _q8_0, Q.Q4_1: _q4_1}[kind]
    chunks = [encode(weight[i : i + CHUNK].to(torch.float32).reshape(-1, in_features // 32, 32))
              for i in range(0, out_features, CHUNK)]
    return torch.cat(chunks).reshape(out_features, -1)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """[rows, groups, 32] fp32 -> [rows, groups, 34] uint8: f16 d = amax / 127, q rounded half away from 0."""
    d = blocks.abs().amax(-1, keepdim=True) / 127
    v = blocks * _inverse(d)
    a = v.abs()
    floored = torch.floor(a)
    q = (torch.sign(v) * (floored + torch.floor(2 * (a - floored)))).to(torch.int8)  # their np_roundf, op for op
    return torch.cat([_f16_bytes(d), q.view(torch.uint8)], -1)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """[rows, groups, 32] fp32 -> [rows, groups, 20] uint8: f16 d = (max - min) / 15, f16 min, nibbles
    (value i low, value i + 16 high)."""
    high, low = blocks.amax(-1, keepdim=True), blocks.amin(-1, keepdim=True)
    d = (high - low) / 15
    q = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([_f16_bytes(d), _f16_bytes(low), packed], -1)
