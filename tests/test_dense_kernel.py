"""The fp32 product of few rows (lanes/quant/cpu_dense.cpp, `dense_product`): within fp32 summation of the
float64 product, and batch invariant: a row's output has the same bits alone, as one of a drafted lane's
1 + k rows, or anywhere among 16, which is what lets drafted decoding equal plain decoding on fp32 weights.

Rules: random weights and rows made here; the reference is the float64 product; skipped only where the
kernels cannot be built.
"""

import pytest
import torch
import torch.nn.functional as F

from lanes.quant import weight
from lanes.quant.native import available, kernels
from lanes.quant.weight import DenseWeight, dense_product, few_rows, few_rows_for

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels cannot be built here (neither AVX-512 nor AVX2)")
ROWS = min(few_rows(), 64) if available() else 0  # the row counts the kernel takes here, up to 64 of them


def operands(rows: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("n,k", [(1, 16), (4, 33), (7, 576), (130, 1000), (5, 1)])
def test_each_row_count_is_within_fp32_summation_of_the_float64_product(n, k, spread):
    x, w = operands(ROWS, n, k)
    exact = x.double() @ w.double().T
    # an fma chain of k / 16 steps in each lane, then a tree of 4 adds over the 16 lanes
    bound = (k / 16 + 5) * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T)
    for rows in range(1, ROWS + 1):
        out = kernels().mm_f32(x[:rows], w, spread)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        assert ((out.double() - exact[:rows]).abs() <= bound[:rows]).all()


@pytest.mark.parametrize("n,k", [(9, 576), (64, 1536), (3, 40)])
def test_a_rows_product_has_the_same_bits_at_any_row_count_and_place(n, k):
    x, w = operands(ROWS, n, k, seed=1)
    alone = torch.cat([kernels().mm_f32(x[i : i + 1], w) for i in range(ROWS)])
    for rows in range(1, ROWS + 1):
        assert torch.equal(kernels().mm_f32(x[:rows], w), alone[:rows])
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(2))
    assert torch.equal(kernels().mm_f32(x[order], w), alone[order])


@pytest.mark.parametrize("n,k", [(9, 576), (130, 1536), (3, 40)])
def test_where_the_weights_are_fetched_from_changes_no_bit(n, k):
    """The two fetch schedules (`spread_fetch_for`) prefetch and nothing else."""
    x, w = operands(ROWS, n, k, seed=3)
    for rows in range(1, ROWS + 1):
        assert torch.equal(kernels().mm_f32(x[:rows], w, True), kernels().mm_f32(x[:rows], w, False))


def test_no_rows_give_an_empty_product():
    x, w = operands(0, 8, 32)
    assert kernels().mm_f32(x, w).shape == (0, 8)


def test_mismatched_shapes_are_refused():
    x, w = operands(2, 8, 32)
    with pytest.raises(RuntimeError, match="mm_f32 takes fp32 x"):
        kernels().mm_f32(x, w[:, :16])
    with pytest.raises(RuntimeError, match="mm_f32 takes fp32 x"):
        kernels().mm_f32(x.double(), w)


def test_the_kernel_takes_fp32_products_up_to_the_rows_measured_for_the_cpu():
    assert [few_rows_for("avx512", "GenuineIntel"), few_rows_for("avx2", "AuthenticAMD"),
            few_rows_for("avx2", "GenuineIntel")] == [16, 64, 64]
    assert few_rows_for("avx512", "AuthenticAMD") == few_rows_for("avx512-fp32", "AuthenticAMD") == weight.EVERY_ROW
    assert few_rows_for("avx512", "") == 16  # an unknown maker: the threshold measured against a working MKL
    # the fetch over every x tile where it was measured faster: AMD's AVX-512 alone
    assert [weight.spread_fetch_for(b, v) for b in ("avx512", "avx512-fp32", "avx2") for v in ("AuthenticAMD", "GenuineIntel", "")] \
        == [True, False, False, True, False, False, False, False, False]


def test_few_fp32_rows_take_the_kernel_with_the_bias_added_and_the_rest_take_torch(monkeypatch):
    monkeypatch.setattr(weight, "few_rows", lambda: 16)
    x, w = operands(16 + 1, 48, 96, seed=3)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4))
    assert torch.equal(dense_product(x[:16], w), kernels().mm_f32(x[:16], w))
    assert torch.equal(dense_product(x[:3], w, bias), kernels().mm_f32(x[:3], w) + bias)
    assert torch.equal(DenseWeight(w).matmul(x[:3]), kernels().mm_f32(x[:3], w))
    assert torch.equal(dense_product(x, w, bias), F.linear(x, w, bias))  # a prompt's many rows
    strided = torch.randn(96, 48).T  # a weight that is a view: torch reads it where it lies, no copy a pass
    assert torch.equal(dense_product(x[:2], strided), F.linear(x[:2], strided))
    assert torch.equal(dense_product(x[:2].bfloat16(), w.bfloat16()), F.linear(x[:2].bfloat16(), w.bfloat16()))
