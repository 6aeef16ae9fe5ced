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
    """Every nn.Linear of a transformers model multiplies `in_8_bits` of its input while this holds (MoE
    experts' stacked tensors and routers are not nn.Linear: we hold those dequantized, in full precision)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for linear in linears:
        linear.forward = lambda x, linear=linear: F.linear(in_8_bits(x), linear.weight, linear.bias)
    try:
        yield model
    finally:
        for linear in linears:
            del linear.forward


def assert_same_in_8_bits(ours, reference, prompt_ids, steps: int = 8, atol: float = 1e-4,
                          after_a_tie: float = 0.25) -> None:
    """A scenario's outputs (`scenario.run`) against transformers with each linear's input rounded to 8 bits
    as the integer kernels round it: every row within `atol` up to a position where the reference's
    rounding is a near tie (`near_ties`), which our fp32 inputs may round the other way by one step; from
    there on within `after_a_tie` (one value of a group moved by its scale); the greedy tokens all equal."""
    import scenario

    with activations_in_8_bits(reference):
        theirs = scenario.reference(reference, prompt_ids, ours[2], steps=steps)
    tight = 0
    for ids, mine, ref in zip(prompt_ids, ours[0], theirs[0]):
        tie = near_ties(reference, ids)
        torch.testing.assert_close(mine[:tie], ref[:tie], rtol=0, atol=atol)
        torch.testing.assert_close(mine, ref, rtol=0, atol=after_a_tie)
        tight += len(mine[:tie])
    for step, (mine, ref) in enumerate(zip(ours[1], theirs[1])):
        for i, (ids, sequence) in enumerate(zip(prompt_ids, ours[2])):
            tie = near_ties(reference, sequence[: len(ids) + step + 1])
            torch.testing.assert_close(mine[i], ref[i], rtol=0, atol=atol if tie is None else after_a_tie)
    assert ours[2] == theirs[2]
    assert tight > 0


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


def integer_products() -> bool:
    """Whether Q8_0 / Q4_0 / Q4_1 weights multiply in integers here (else they are dequantized at load)."""
    from lanes.quant import unavailable_reason

    return unavailable_reason() is None


def assert_equals_transformers_in_8_bits(model, reference, steps: int = 8) -> None:
    """scenario.assert_equals_transformers for a model whose matrices multiply in integers: against
    `reference` (float64 is best: near ties are judged on its inputs) with activations in 8 bits."""
    import scenario
    from lanes.core.blocks import BlockPool

    if not integer_products():
        scenario.assert_equals_transformers(model, reference, steps=steps)
        return
    pool = BlockPool(model.kv_blocks)
    prompt_ids = scenario.prompts(model.config.vocab_size)
    ours = scenario.run(model.decoder, pool, prompt_ids, steps=steps)
    assert_same_in_8_bits(ours, reference, prompt_ids, steps=steps)
    pool.check_integrity()
