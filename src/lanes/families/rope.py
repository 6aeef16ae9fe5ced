"""Rotary position embeddings: inverse frequencies for each scaling a config names, and their application."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..quant.native import available
from .config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] float32, attention scaling applied to cos and sin) as transformers computes
    them; `rotary_dim` is the head dimension, or its rotated share under partial rotary."""
    rope, dim = config.rope, config.rotary_dim
    base = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (rope.theta**base)
    if rope.kind == "default":
        return inv_freq, 1.0
    factor = float(rope.get("factor", 1.0))
    if rope.kind == "linear":
        return inv_freq / factor, 1.0
    if rope.kind == "llama3":
        return _llama3(inv_freq, factor, config), 1.0
    if rope.kind == "yarn":
        return _yarn(config, factor, dim)
    if rope.kind == "freq_factors":
        return inv_freq / torch.tensor(rope.get("freq_factors"), dtype=torch.float32), 1.0
    raise ValueError(f"unknown RoPE kind {rope.kind!r}")


def _llama3(inv_freq: torch.Tensor, factor: float, config: ModelConfig) -> torch.Tensor:
    rope = config.rope
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_context = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(config: ModelConfig, factor: float, dim: int) -> tuple[torch.Tensor, float]:
    rope = config.rope
    theta = rope.theta
    original = rope.get("original_max_position_embeddings") or config.max_position
    attention = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention is None:
        if mscale and mscale_all_dim:
            attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention = get_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


# Values of cos and sin computed by one op at most: under torch's grain for splitting an op across threads
# (32768), and rows of whole vector steps, keep every value out of a vector loop's scalar tail (libm's cos
# and sin differ from the vector ones by an ulp): so a position's values are the same in any pass.
ROPE_VALUES = 16384


def cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rotary_dim] for positions [T], computed in float32 and cast as transformers does."""
    width = 2 * inv_freq.shape[0]
    padded = width + -width % 64
    rows = max(1, ROPE_VALUES // padded)
    if positions.shape[0] > rows:
        parts = [cos_sin(inv_freq, scale, chunk, dtype) for chunk in positions.split(rows)]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = F.pad(torch.cat((freqs, freqs), dim=-1), (0, padded - width))
    return (emb.cos()[:, :width] * scale).to(dtype), (emb.sin()[:, :width] * scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, R] with R <= D. The half-split rotation of Hugging Face checkpoints over
    the first R dimensions of each head; the other D - R pass through (partial rotary)."""
    if cos.shape[-1] < x.shape[-1]:
        rotary = cos.shape[-1]
        return torch.cat((apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    if (x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.dim() == 3
            and x.stride(2) == 1 and x.stride(1) == x.shape[2] and available()):
        return torch.ops.lanes_quant.rope(x, cos, sin)  # the same values in one op (lanes/quant/cpu_rope.cpp)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
