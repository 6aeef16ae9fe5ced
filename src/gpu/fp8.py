"""The fp8 KV cache's number format, eagerly in torch: e4m3 values with a power-of-two scale for each
token's head, kept as its exponent (one int8).

A head's vector x [D] is stored as e4m3(x * 2^-e) with e = floor(log2(max |x|)) - 7, so its largest
element lands in [128, 256) (e4m3 tops out at 448: never saturated) and x = value * 2^e exactly on the way
back. The scale is a power of two, so scaling is exact and the only rounding is e4m3's own (round to
nearest even, 3 mantissa bits: a relative error of at most 2^-4 an element, subnormals below 2^-6 of the
scaled value). The Triton kernels compute the same exponents and the same rounding (`kernels.py`).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
TOP = 7  # a head's largest element is scaled into [2^TOP, 2^(TOP + 1))
LOWEST, HIGHEST = -120, 120  # exponents clamped so both 2^e and 2^-e stay normal float32 numbers


def exponents(x: torch.Tensor) -> torch.Tensor:
    """x: [..., D] any float dtype -> [..., ] int8: each vector's exponent e (an all-zero vector gets LOWEST)."""
    amax = x.float().abs().amax(dim=-1)
    _, e = torch.frexp(amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2 amax) = e - 1
    e = torch.where(amax > 0, e - 1 - TOP, torch.full_like(e, LOWEST))
    return e.clamp(LOWEST, HIGHEST).to(torch.int8)


def powers(e: torch.Tensor) -> torch.Tensor:
    """int8 exponents [...] -> float32 [...] 2^e, exactly."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e.to(torch.int32))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H, D] -> (values [T, H, D] float8_e4m3fn, exponents [T, H] int8)."""
    e = exponents(x)
    return (x.float() * powers(-e)[..., None]).to(FP8), e


def dequantize(values: torch.Tensor, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] float8_e4m3fn, exponents [...] int8 -> [..., D] in `dtype` (exact in bf16 and fp32)."""
    return (values.float() * powers(e)[..., None]).to(dtype)
