"""The fp8 KV format of `lanes.gpu.fp8` inside Triton kernels: the same exponents, the same rounding.

The rounding to e4m3 is done in float32 before the cast (so the cast itself is exact): Triton's
interpreter rounds a float32 that carries into the next binade wrongly (31.6 became 16), and rounding
ourselves keeps the interpreter, the GPU and torch's cast bit for bit the same.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import fp8

TOP = tl.constexpr(fp8.TOP)
LOWEST = tl.constexpr(fp8.LOWEST)
HIGHEST = tl.constexpr(fp8.HIGHEST)


@triton.jit
def exponent_of(amax):
    """float32 amax >= 0 -> int32 floor(log2 amax) - TOP, clamped (zero and subnormals: LOWEST)."""
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.where(amax > 0, biased - 127 - TOP, LOWEST)
    return tl.minimum(tl.maximum(e, LOWEST), HIGHEST)


@triton.jit
def power_of(e):
    """int32 e within the clamp -> float32 2^e, exactly (built from its bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(x):
    """float32 x, |x| <= 448 -> the nearest e4m3 value (ties to even), still float32."""
    bits = x.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    step = tl.maximum(biased - 3, 127 - 9)  # the grid's spacing: 3 mantissa bits, subnormals at 2^-9
    magic = ((step + 23) << 23).to(tl.float32, bitcast=True)  # adding it leaves `step` as the last bit
    r = (tl.abs(x) + magic) - magic
    return tl.where(bits < 0, -r, r)


@triton.jit
def quantize(x, e):
    """float32 x scaled by 2^-e and rounded -> float8e4nv (exactly torch's cast of x * 2^-e)."""
    return round_e4m3(x * power_of(-e)).to(tl.float8e4nv)
