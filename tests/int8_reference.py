"""References for the integer kernels (Q8_0, Q4_0, Q4_1): activations rounded to 8 bits a group of 32 as
llama.cpp's Q8 activation blocks round them (d = amax / 127 in fp32, q = round-half-even(x * (127 / amax))),
so that a reference computes x̂ @ dequantize(w).T, the product the kernels compute in integers."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def in_8_bits(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) as the kernels see it, d * q, in x's dtype (exact in float64)."""
    groups = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    d = amax / 127
    inverse = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)
    q = torch.round(groups * inverse)  # fp32 product, then to nearest, ties to even (as vcvtps2dq)
    return (q.double() * d.double()).reshape(x.shape).to(x.dtype)


@contextlib.contextmanager
def activations_in_8_bits(model: torch.nn.Module):
    """Every nn.Linear of a transformers model multiplies `in_8_bits` of its input while this holds."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for linear in linears:
        linear.forward = lambda x, linear=linear: F.linear(in_8_bits(x), linear.weight, linear.bias)
    try:
        yield model
    finally:
        for linear in linears:
            del linear.forward


def near_ties(model: torch.nn.Module, ids: list[int], margin: float = 1e-4) -> int | None:
    """The first position of `ids` at which some linear's input, times 127 / amax, lies within `margin` of
    a rounding boundary (k + 1/2) under `activations_in_8_bits`: there our fp32 inputs, which differ from
    the float64 reference's by ~1e-6 of their size, may round the other way, and later positions attend
    to it. None when there is none."""
    first: list[int] = []

    def hook(module, inputs, output):
        groups = inputs[0].float().reshape(*inputs[0].shape[:-1], -1, 32)
        amax = groups.abs().amax(-1, keepdim=True)
        scaled = groups * torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)
        close = ((scaled - scaled.floor() - 0.5).abs() < margin).any(-1).any(-1)  # [batch, positions]
        hits = close[0].nonzero()
        if len(hits):
            first.append(int(hits[0]))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad(), activations_in_8_bits(model):
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return min(first) if first else None
