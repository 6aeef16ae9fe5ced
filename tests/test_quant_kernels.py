"""lanes.quant's kernels against the gguf package: every GGUF block format decoded bit for bit as
`gguf.quants.dequantize` decodes it, and matmuls within fp32's summation bound of x @ dequantize(raw).T,
where for Q8_0, Q4_0 and Q4_1 x is rounded to 8 bits a group of 32 first (int8_reference.in_8_bits).

Rules: random blocks made here (the gguf package's quantizer for Q8_0/Q4_0/Q4_1, random bytes with sane
f16 scales for the K-quants, which it cannot quantize); the reference product in float64; skipped only on
a CPU without AVX-512.
"""

import gguf
import numpy as np
import pytest
import torch

import tiny_gguf
from int8_reference import in_8_bits
from lanes.quant import FORMATS, QuantWeight, block_format
from lanes.quant import weight as weight_module

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
INTEGER = {Q.Q8_0, Q.Q4_0, Q.Q4_1}  # multiplied in integers: activations rounded to 8 bits a group of 32

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the kernels need AVX-512")


def random_raw(kind: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, row bytes] uint8 of format `kind` with weights of size ~0.02."""
    if kind in tiny_gguf.K_LAYOUT:
        return tiny_gguf.random_k_blocks(rows, cols, kind, scale=1e-3, seed=seed)
    if kind == Q.Q6_K:  # f16 d at byte 208 of each 210-byte block; int8 scales and 6-bit q random
        blocks = np.random.default_rng(seed).integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
        blocks[:, :, 208:210] = np.full((rows, cols // 256), 2e-5, np.float16).view(np.uint8).reshape(rows, -1, 2)
        return blocks.reshape(rows, -1)
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.02
    return gguf.quants.quantize(values, kind)


def weight_of(kind: Q, rows: int, cols: int, seed: int = 0) -> tuple[QuantWeight, np.ndarray]:
    raw = random_raw(kind, rows, cols, seed)
    reference = gguf.quants.dequantize(raw, kind).reshape(rows, cols)
    return QuantWeight(torch.from_numpy(raw.copy()), block_format(kind), (rows, cols)), reference


def summation_bound(x: torch.Tensor, reference: np.ndarray) -> torch.Tensor:
    """|fl32(sum x_i w_i) - sum x_i w_i| <= gamma_K sum |x_i w_i|, gamma_K = K u / (1 - K u), u = 2^-24,
    for any order of the K additions (with or without fma); plus float64's own error in the reference."""
    k = x.shape[1]
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24) + 2 * k * 2.0**-53
    return gamma * (x.double().abs() @ torch.from_numpy(np.abs(reference)).double().T)


def expected(kind: Q, raw: np.ndarray, reference: np.ndarray, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product the kernels round, and the bound on their rounding: for the integer types x is
    rounded to 8 bits first, and a Q4_1 value d q + m is summed as its two terms (|d q| + |m| bounds them)."""
    if kind not in INTEGER:
        return x.double() @ torch.from_numpy(reference).double().T, summation_bound(x, reference)
    x8 = in_8_bits(x.double())
    magnitude = np.abs(reference).astype(np.float64)
    if kind == Q.Q4_1:
        m = raw.reshape(raw.shape[0], -1, 20)[:, :, 2:4].copy().view(np.float16).astype(np.float64)  # [rows, groups, 1]
        magnitude = (np.abs(reference.reshape(m.shape[0], -1, 32) - m) + np.abs(m)).reshape(reference.shape)
    return x8 @ torch.from_numpy(reference).double().T, summation_bound(x8, magnitude)


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_every_value_decodes_as_the_gguf_package_decodes_it(kind):
    w, reference = weight_of(kind, 13, 512)
    assert np.array_equal(w.dequantize().numpy().view(np.uint32), reference.view(np.uint32))  # bit for bit, signs of zero too


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 31, 32, 33, 64])  # both paths, either side of PANEL_ROWS
def test_matmul_is_within_fp32_summation_of_the_dequantized_product(kind, rows):
    w, reference = weight_of(kind, 67, 768, seed=rows)  # 67 rows: a partial tile of 4 and of a 64-row panel
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    exact, bound = expected(kind, random_raw(kind, 67, 768, seed=rows), reference, x)
    got = w.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 67)
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("kind", sorted(INTEGER), ids=lambda k: k.name)
@pytest.mark.parametrize("width", [32, 64, 96, 224, 480, 512, 1056])  # chunks of 16, 8, 4, 2 and 1 groups
def test_integer_kernels_take_any_width_in_whole_groups(kind, width):
    w, reference = weight_of(kind, 21, width, seed=width)
    assert np.array_equal(w.dequantize().numpy().view(np.uint32), reference.view(np.uint32))
    x = torch.randn(9, width, generator=torch.Generator().manual_seed(width))
    exact, bound = expected(kind, random_raw(kind, 21, width, seed=width), reference, x)
    assert ((w.matmul(x).double() - exact).abs() <= bound).all()
    assert torch.equal(w.matmul(x), torch.cat([w.matmul(x[i : i + 1]) for i in range(9)]))


@pytest.mark.parametrize("kind", sorted(INTEGER), ids=lambda k: k.name)
def test_rounding_activations_to_8_bits_costs_at_most_half_a_step_a_value(kind):
    """The type's rounding bound against the full-precision product: |w_i| d/2 a value, d = amax / 127."""
    w, reference = weight_of(kind, 40, 576, seed=7)
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(7)) * torch.linspace(0.01, 10, 576)
    steps = (x.abs().reshape(6, -1, 32).amax(-1) / 127).repeat_interleave(32, dim=1).double()
    half_step = (steps / 2) @ torch.from_numpy(np.abs(reference)).double().T
    error = (w.matmul(x).double() - x.double() @ torch.from_numpy(reference).double().T).abs()
    assert (error <= half_step * (1 + 1e-5) + summation_bound(x, reference)).all()
    assert (x - in_8_bits(x)).abs().le(steps / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_a_rows_product_is_the_same_bits_on_either_path_at_any_row_count(kind, monkeypatch):
    """Batch invariance: what drafted decoding needs to equal plain decoding exactly."""
    w, _ = weight_of(kind, 300, 512)  # 300 rows: several panels, partial tiles
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(1))
    one = torch.cat([w.matmul(x[i : i + 1]) for i in range(70)])
    for rows in (2, 5, 9, 10, 11, 17, 21, 31, 32, 33, 70):  # x tiles of up to 10 rows, split near-evenly
        assert torch.equal(w.matmul(x[:rows]), one[:rows]), rows
    monkeypatch.setattr(weight_module, "PANEL_ROWS", 1)
    assert torch.equal(w.matmul(x[:1]), one[:1]) and torch.equal(w.matmul(x[:7]), one[:7])


def test_bf16_activations_come_back_in_bf16_rounded_once():
    w, reference = weight_of(Q.Q4_K, 32, 256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = w.matmul(x)
    exact = x.double() @ torch.from_numpy(reference).double().T
    assert got.dtype == torch.bfloat16
    bound = summation_bound(x.float(), reference) * 1.01 + exact.abs() * 2.0**-8  # bf16 keeps 8 bits
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_take_returns_the_dequantized_rows_asked_for(kind):
    w, reference = weight_of(kind, 9, 256)
    ids = torch.tensor([8, 0, 3, 3])
    assert torch.equal(w.take(ids, torch.float32), torch.from_numpy(reference[[8, 0, 3, 3]]))
    with pytest.raises(RuntimeError, match="out of range"):
        w.take(torch.tensor([9]), torch.float32)


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_resident_bytes_are_the_file_bytes(kind):
    w, _ = weight_of(kind, 24, 512)
    assert w.resident_bytes == 24 * 512 // FORMATS[int(kind)].values * FORMATS[int(kind)].bytes
    assert w.type_name == kind.name


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_the_kernels_layout_holds_the_files_bytes(kind):
    raw = random_raw(kind, 5, 512, seed=3)
    w = QuantWeight(torch.from_numpy(raw.copy()), block_format(kind), (5, 512))
    assert w.packed.shape == raw.shape and np.array_equal(w.file_bytes().numpy(), raw)


def test_a_row_must_be_whole_blocks():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        QuantWeight(torch.zeros(2, 144, dtype=torch.uint8), block_format(Q.Q4_K), (2, 288))
    with pytest.raises(ValueError, match=r"needs uint8 \[2, 144\]"):
        QuantWeight(torch.zeros(2, 140, dtype=torch.uint8), block_format(Q.Q4_K), (2, 256))


def test_torch_compile_traces_through_the_kernels_in_one_graph():
    w, reference = weight_of(Q.Q4_1, 24, 256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(lambda x: torch.relu(w.matmul(x)) * 2, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), torch.relu(w.matmul(x)) * 2)


def test_many_rows_run_under_inference_mode():
    w, reference = weight_of(Q.Q4_1, 80, 256)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        got = w.matmul(x)
    exact, bound = expected(Q.Q4_1, random_raw(Q.Q4_1, 80, 256, seed=0), reference, x)
    assert ((got.double() - exact).abs() <= bound).all()
