"""lanes.gpu.quant: GGUF weights on the GPU (Q8_0, Q4_K, Q6_K) in their bytes, against the gguf package.

Rules: runs on CUDA where there is a GPU, else on the CPU under Triton's interpreter (TRITON_INTERPRET=1,
set here for these imports when nothing set it), else skips. The gguf package's dequantization is the
reference: decoded weights equal bit for bit; fp32 products within the fp32 summation bound of any order;
bf16 products within 1e-2 relative error (METHOD's bf16 band; the interpreter rounds to bf16 by truncation).
"""

import os
import sys

import gguf
import numpy as np
import pytest
import torch

from lanes.gpu.device import cuda_device_count
from lanes.quant import FORMATS, DenseWeight, stack_rows
from lanes.quant.build import from_gguf

from test_quant_kernels import random_raw, summation_bound

SET_HERE = cuda_device_count() == 0 and "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules
if SET_HERE:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is decorated, so only for these imports
try:
    if cuda_device_count() == 0 and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton's interpreter is not on (TRITON_INTERPRET=1)", allow_module_level=True)
    pytest.importorskip("triton")
    from lanes.gpu import quant as gpu_quant
    from lanes.gpu import quant_kernels
    from lanes.gpu.quant import CudaQuantWeight
    if SET_HERE:
        import triton.experimental.gluon  # noqa: F401  (imported at the first launch, and asserts the interpreter then)
    if cuda_device_count() == 0 and not quant_kernels.INTERPRETED:
        pytest.skip("the kernels were imported before Triton's interpreter was on", allow_module_level=True)
finally:
    if SET_HERE:
        del os.environ["TRITON_INTERPRET"]
DEVICE = "cuda" if cuda_device_count() else "cpu"
Q = gguf.GGMLQuantizationType
KINDS = [Q.Q8_0, Q.Q4_K, Q.Q6_K]
COLS = {Q.Q8_0: 320, Q.Q4_K: 512, Q.Q6_K: 512}  # Q8_0's rows end inside a 256-value step


def weight(kind, rows: int, seed: int = 0) -> tuple[CudaQuantWeight, np.ndarray]:
    raw = random_raw(kind, rows, COLS[kind], seed)
    reference = gguf.quants.dequantize(raw, kind).reshape(rows, COLS[kind])
    return CudaQuantWeight(torch.from_numpy(raw.copy()).to(DEVICE), FORMATS[int(kind)], (rows, COLS[kind])), reference


def within_summation_bound(mine: torch.Tensor, x: torch.Tensor, reference: np.ndarray) -> None:
    exact = x.double() @ torch.from_numpy(reference).double().T
    assert ((mine.double().cpu() - exact).abs() <= summation_bound(x, reference) + 1e-30).all()


def relative(mine: torch.Tensor, ref: torch.Tensor) -> float:
    return ((mine.double().cpu() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_decoded_weights_equal_the_gguf_package_bit_for_bit(kind):
    w, reference = weight(kind, 21, seed=1)
    assert torch.equal(w.dequantize(torch.float32).cpu(), torch.from_numpy(reference))
    assert torch.equal(w.dequantize(torch.bfloat16).cpu().float(), quant_kernels_round(torch.from_numpy(reference)))
    raw = random_raw(kind, 21, COLS[kind], 1)
    assert w.resident_bytes == raw.nbytes and torch.equal(w.file_bytes().cpu(), torch.from_numpy(raw))
    assert w.type_name == kind.name and w.shape == (21, COLS[kind])


def quant_kernels_round(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 as the device rounds: to nearest on a GPU, toward zero in the interpreter."""
    if DEVICE == "cuda":
        return values.bfloat16().float()
    return (values.view(torch.int32) & ~0xFFFF).view(torch.float32)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("block_n, sb, split_k", [(4, 1, 1), (4, 1, 2), (2, 4, 1), (1, 8, 2)])  # steps past the row's end
def test_gemv_is_within_the_fp32_summation_bound(kind, rows, block_n, sb, split_k):
    w, reference = weight(kind, 37, seed=rows)
    x = torch.randn(rows, COLS[kind], generator=torch.Generator().manual_seed(rows))
    out = quant_kernels.gemv(x.to(DEVICE), w.packed, int(kind), 37, COLS[kind], block_n=block_n, sb=sb, split_k=split_k)
    assert out.dtype == torch.float32 and out.shape == (rows, 37)
    within_summation_bound(out, x, reference)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [9, 40])
def test_the_tensor_core_product_is_within_the_fp32_summation_bound(kind, rows):
    w, reference = weight(kind, 24, seed=rows)
    x = torch.randn(rows, COLS[kind], generator=torch.Generator().manual_seed(rows))
    out = quant_kernels.mm(x.to(DEVICE), w.packed, int(kind), 24, COLS[kind], block_m=16, block_n=16)
    within_summation_bound(out, x, reference)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows, prefill", [(1, "fused"), (5, "fused"), (33, "fused"), (33, "dequantize")])
def test_matmul_in_bf16_is_within_the_bf16_band(kind, rows, prefill, monkeypatch):
    monkeypatch.setattr(gpu_quant, "PREFILL", prefill)
    w, reference = weight(kind, 40, seed=2)
    x = torch.randn(rows, COLS[kind], generator=torch.Generator().manual_seed(3)).bfloat16()
    out = w.matmul(x.to(DEVICE))
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 40) and not torch.isnan(out).any()
    assert relative(out, x.double() @ torch.from_numpy(reference).double().T) < 1e-2


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_rows_take_and_stacking_move_whole_rows(kind):
    w, reference = weight(kind, 16, seed=4)
    other, other_ref = weight(kind, 8, seed=5)
    ids = torch.tensor([3, 0, 15, 3])
    assert torch.equal(w.take(ids, torch.float32).cpu(), torch.from_numpy(reference[ids.numpy()]))
    picked = w.rows(torch.tensor([2, 5]))
    assert picked.shape == (2, COLS[kind]) and torch.equal(picked.dequantize().cpu(), torch.from_numpy(reference[[2, 5]]))
    stacked = stack_rows([w, other])
    assert isinstance(stacked, CudaQuantWeight) and stacked.shape == (24, COLS[kind])
    assert torch.equal(stacked.dequantize().cpu(), torch.from_numpy(np.concatenate([reference, other_ref])))


def test_a_format_without_a_cuda_kernel_is_refused_by_name():
    raw = random_raw(Q.Q4_0, 4, 64, 0)
    with pytest.raises(ValueError, match="Q4_0 has no CUDA kernel"):
        CudaQuantWeight(torch.from_numpy(raw.copy()), FORMATS[int(Q.Q4_0)], (4, 64))


@pytest.mark.skipif(DEVICE != "cuda", reason="from_gguf's CUDA branch needs a GPU")
@pytest.mark.parametrize("kind", KINDS + [Q.Q4_0], ids=lambda k: k.name)
def test_from_gguf_on_cuda_keeps_kernel_formats_and_dequantizes_the_rest(kind):
    cols = 512
    raw = random_raw(kind, 8, cols, 6)
    w = from_gguf(raw, kind, (8, cols), torch.bfloat16, device="cuda")
    reference = torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(8, cols))
    if kind == Q.Q4_0:
        assert isinstance(w, DenseWeight) and w.tensor.is_cuda and w.type_name == "Q4_0 (held as BF16)"
        assert torch.equal(w.tensor.cpu(), reference.bfloat16())
    else:
        assert isinstance(w, CudaQuantWeight) and w.packed.is_cuda and w.resident_bytes == raw.nbytes
        assert torch.equal(w.dequantize().cpu(), reference)
