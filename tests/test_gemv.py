"""The small-batch GEMV kernels against float64 products of the same inputs, and their fused prologues and
epilogues against kernels.add_rms_norm and kernels.silu_mul bit for bit.

Rules: runs on CUDA where there is a GPU, else on the CPU under Triton's interpreter: TRITON_INTERPRET=1,
set here when the shell has not set it and nothing has imported Triton yet, for the imports below and
this module's tests only (modules collected later keep their own rule), else skips. Every output element
is within its bound: one rounding of the result (one unit in the last place of the float64 reference: the
interpreter truncates, a GPU rounds to nearest) plus float32 accumulation's worst case (K * 2^-24 *
sum |x w|). The fused kernels' h and silu products are checked exactly, through identity weights (a
product with one nonzero term is exact). Shapes are small (the interpreter is slow) with N and K off the
tile sizes; fresh random inputs per case.
"""

import os
import sys

import pytest
import torch

from lanes.gpu.device import cuda_device_count

SET_HERE = cuda_device_count() == 0 and "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules
if SET_HERE:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated, so only for these imports
try:
    if cuda_device_count() == 0 and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton's interpreter is not on (TRITON_INTERPRET=1)", allow_module_level=True)
    pytest.importorskip("triton")
    from lanes.gpu import gemv as gemv_module
    from lanes.gpu import kernels
    from lanes.gpu.gemv import (GemvConfig, default_config, gated_config, gemv, norm_gate_up_silu, norm_gemv,
                                silu_config, silu_gemv)
    if cuda_device_count() == 0 and not (kernels.INTERPRETED and gemv_module.INTERPRETED):
        pytest.skip("the kernels were imported before Triton's interpreter was on", allow_module_level=True)
finally:
    if SET_HERE:
        del os.environ["TRITON_INTERPRET"]
DEVICE = "cuda" if cuda_device_count() else "cpu"


@pytest.fixture(autouse=True)
def interpreter_on(monkeypatch):
    if SET_HERE:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton reads it again as it launches

FMA = GemvConfig(block_n=32, block_k=32)
SPLIT = GemvConfig(block_n=16, block_k=64, split_k=2, block_m=4)  # FMA over 4 rows, K split in two
DOT = GemvConfig(block_n=16, block_k=32, split_k=3, block_m=16, dot=True)
MANTISSA = {torch.bfloat16: 7, torch.float32: 23}


def ulp(ref: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of dtype's values at |ref| (float64)."""
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0**-126))) - MANTISSA[dtype])


def bound(x64: torch.Tensor, w64: torch.Tensor, ref64: torch.Tensor, dtype) -> torch.Tensor:
    """One rounding of the result plus float32 accumulation's worst case over K terms."""
    return ulp(ref64, dtype) + x64.shape[1] * 2.0**-24 * (x64.abs() @ w64.abs().T)


def within(mine: torch.Tensor, ref64: torch.Tensor, limit: torch.Tensor) -> None:
    assert mine.shape == ref64.shape and not torch.isnan(mine).any()
    excess = ((mine.double().cpu() - ref64).abs() - limit).max().item()
    assert excess <= 0, excess


def inputs(g, m: int, n: int, k: int, dtype, bias: bool):
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("config, m, n, k, bias", [
    (FMA, 1, 48, 64, True), (FMA, 3, 200, 96, False), (SPLIT, 3, 200, 96, True), (SPLIT, 1, 48, 256, False),
    (DOT, 16, 100, 256, True), (DOT, 3, 200, 96, False),
], ids=str)
def test_gemv_equals_linear(config, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = inputs(g, m, n, k, torch.bfloat16, bias)
    mine = gemv(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE) if bias else None, config)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double() if bias else None)
    within(mine, ref, bound(x.double(), w.double(), ref, torch.bfloat16))


@pytest.mark.parametrize("config", [FMA, DOT, None], ids=str)
def test_gemv_in_float32(config):
    g = torch.Generator().manual_seed(7)
    x, w, b = inputs(g, 3, 72, 80, torch.float32, True)
    mine = gemv(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), config)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    within(mine, ref, bound(x.double(), w.double(), ref, torch.float32))


@pytest.mark.parametrize("config, m, k, with_residual", [
    (FMA, 1, 64, True), (FMA, 3, 96, False), (SPLIT, 3, 96, True), (DOT, 16, 64, True), (DOT, 1, 96, False),
], ids=str)
def test_norm_gemv_is_add_rms_norm_then_linear(config, m, k, with_residual):
    g = torch.Generator().manual_seed(m + k)
    x, w, b = inputs(g, m, 72, k, torch.bfloat16, True)
    residual = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, torch.bfloat16)
    x = x.to(DEVICE)
    h, expected_residual = kernels.add_rms_norm(x, residual, norm_weight, 1e-6)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)
    same_h, new_residual = norm_gemv(x, residual, norm_weight, 1e-6, eye, None, config)
    assert torch.equal(same_h, h)
    assert torch.equal(new_residual, expected_residual)
    assert (new_residual.data_ptr() == x.data_ptr()) == (residual is None)
    mine, _ = norm_gemv(x, residual, norm_weight, 1e-6, w.to(DEVICE), b.to(DEVICE), config)
    h64 = h.double().cpu()
    ref = torch.nn.functional.linear(h64, w.double(), b.double())
    within(mine, ref, bound(h64, w.double(), ref, torch.bfloat16))


@pytest.mark.parametrize("config, m, inter, n", [(FMA, 1, 96, 48), (SPLIT, 3, 64, 130), (DOT, 3, 96, 130)], ids=str)
def test_silu_gemv_is_silu_mul_then_linear(config, m, inter, n):
    g = torch.Generator().manual_seed(m + inter + n)
    gate_up = torch.randn(m, 2 * inter, generator=g).to(DEVICE, torch.bfloat16)
    act = kernels.silu_mul(gate_up)
    eye = torch.eye(inter, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(silu_gemv(gate_up, eye, None, config), act)
    _, w, _ = inputs(g, m, n, inter, torch.bfloat16, False)
    act64 = act.double().cpu()
    ref = torch.nn.functional.linear(act64, w.double())
    within(silu_gemv(gate_up, w.to(DEVICE), None, config), ref, bound(act64, w.double(), ref, torch.bfloat16))


@pytest.mark.parametrize("config, m, k, inter", [(FMA, 1, 64, 40), (SPLIT, 3, 96, 72), (DOT, 3, 64, 40)], ids=str)
def test_norm_gate_up_silu_is_norm_linear_silu_mul(config, m, k, inter):
    g = torch.Generator().manual_seed(m * k + inter)
    x = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16)
    residual = torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, torch.bfloat16)
    h, expected_residual = kernels.add_rms_norm(x, residual, norm_weight, 1e-6)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)
    same, new_residual = norm_gate_up_silu(x, residual, norm_weight, 1e-6, torch.cat([eye, eye]), None, config)
    assert torch.equal(same, kernels.silu_mul(torch.cat([h, h], dim=-1)))  # gate = up = h, rounded as silu_mul rounds
    assert torch.equal(new_residual, expected_residual)
    _, w, b = inputs(g, m, 2 * inter, k, torch.bfloat16, True)
    mine, _ = norm_gate_up_silu(x, residual, norm_weight, 1e-6, w.to(DEVICE), b.to(DEVICE), config)
    h64, w64 = h.double().cpu(), w.double()
    gate_up = torch.nn.functional.linear(h64, w64, b.double())
    gate, up = gate_up.chunk(2, dim=-1)
    err_gate, err_up = bound(h64, w64, gate_up, torch.bfloat16).chunk(2, dim=-1)  # gate and up: rounded once each
    silu = torch.nn.functional.silu(gate)
    err_act = 1.1 * err_gate + ulp(silu.abs() + 1.1 * err_gate, torch.bfloat16)  # |silu'| < 1.1; silu's rounding
    ref = silu * up
    err = err_act * (up.abs() + err_up) + silu.abs() * err_up
    within(mine, ref, err + ulp(ref.abs() + err, torch.bfloat16))


@pytest.mark.parametrize("m, n, k, expected", [
    (1, 1152, 896, GemvConfig(2, 1024)), (1, 9728, 896, GemvConfig(4, 1024)), (1, 151936, 896, GemvConfig(8, 1024)),
    (1, 896, 4864, GemvConfig(1, 1024)), (2, 896, 4864, GemvConfig(2, 1024, block_m=2)),
    (3, 896, 896, GemvConfig(2, 512, block_m=4)), (4, 896, 4864, GemvConfig(32, 128, 5, 16, True, num_stages=4)),
    (16, 1152, 896, GemvConfig(16, 128, block_m=16, dot=True, num_stages=4)),
    (8, 9728, 896, GemvConfig(128, 128, block_m=16, dot=True)),
    (16, 9728, 896, GemvConfig(32, 128, 1, 16, True, num_stages=4)),
    (64, 151936, 896, GemvConfig(128, 128, block_m=64, dot=True)),
])
def test_default_config_follows_the_rule(m, n, k, expected):
    assert default_config(m, n, k) == expected


def test_silu_config_widens_the_tiles():
    assert silu_config(1, 896, 4864) == GemvConfig(4, 2048)
    assert silu_config(2, 896, 4864) == GemvConfig(4, 1024, block_m=2)
    assert silu_config(8, 896, 4864) == GemvConfig(64, 128, 10, 16, True, num_stages=4)


def test_gated_config_halves_the_columns():
    assert gated_config(1, 4864, 896) == GemvConfig(2, 1024)
    assert gated_config(8, 4864, 896) == GemvConfig(64, 128, block_m=16, dot=True)
    assert gated_config(16, 4864, 896) == GemvConfig(16, 128, block_m=16, dot=True, num_stages=4)
