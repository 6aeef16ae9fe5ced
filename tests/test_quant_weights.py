"""lanes.quant's weight objects: built from a GGUF file's tensors as the gguf reader maps them, from
full-precision tensors for `--quantize`, rows picked and stacked; without the kernels, dequantized.

Rules: GGUF files written in tmp_path with the gguf package's writer; the gguf package's quantizer and
dequantizer are the references (bytes compared exactly); skipped only on a CPU without AVX-512.
"""

import gguf
import numpy as np
import pytest
import torch

from lanes.checkpoint.gguf_file import GGUFFile
from lanes.quant import DenseWeight, QuantWeight, StackedWeight, from_gguf, quantized, stack_rows
from lanes.quant import build as build_module
from lanes.quant.quantize import quantize_rows

from test_quant_kernels import random_raw

Q = gguf.GGMLQuantizationType

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the kernels need AVX-512")


def q2_k_raw(rows: int, cols: int) -> np.ndarray:
    """Random Q2_K blocks (a type with no kernel) with f16 d and dmin (bytes 80..83 of 84) set to 1e-3."""
    blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // 256, 84), dtype=np.uint8)
    blocks[:, :, 80:84] = np.full((rows, cols // 256, 2), 1e-3, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture
def gguf_file(tmp_path):
    """A GGUF file with one [48, 512] matrix of each type (torch order: 48 outputs of 512 inputs)."""
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    kinds = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K]
    for i, kind in enumerate(kinds):
        if kind in (Q.F32, Q.F16):
            array = (np.random.default_rng(i).standard_normal((48, 512)) * 0.02).astype(np.float32 if kind == Q.F32 else np.float16)
            writer.add_tensor(kind.name, array)
        else:
            raw = random_raw(kind, 48, 512, seed=i) if kind != Q.Q2_K else q2_k_raw(48, 512)
            writer.add_tensor(kind.name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(tmp_path / "m.gguf")


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda k: k.name)
def test_a_gguf_tensor_stays_in_its_format_at_its_size(gguf_file, kind):
    tensor = gguf_file.tensors[kind.name]
    w = from_gguf(tensor.data, tensor.tensor_type, gguf_file.shape(kind.name), torch.float32)
    assert isinstance(w, QuantWeight) and w.type_name == kind.name and w.shape == (48, 512)
    assert w.resident_bytes == tensor.n_bytes
    assert torch.equal(w.dequantize(), torch.from_numpy(gguf_file.dequantize(kind.name)))


@pytest.mark.parametrize("kind, name", [(Q.F32, "F32"), (Q.F16, "F16 (held as F32)"), (Q.Q2_K, "Q2_K (held as F32)")])
def test_dense_and_kernel_less_types_are_tensors_as_before(gguf_file, kind, name):
    tensor = gguf_file.tensors[kind.name]
    w = from_gguf(tensor.data, tensor.tensor_type, gguf_file.shape(kind.name), torch.float32)
    assert isinstance(w, DenseWeight) and w.type_name == name
    assert torch.equal(w.tensor, torch.from_numpy(gguf_file.dequantize(kind.name).copy()).float())


def test_without_the_kernels_a_gguf_tensor_is_dequantized(gguf_file, monkeypatch):
    monkeypatch.setattr(build_module, "unavailable_reason", lambda: "no AVX-512")
    tensor = gguf_file.tensors["Q4_K"]
    w = from_gguf(tensor.data, tensor.tensor_type, (48, 512), torch.bfloat16)
    assert isinstance(w, DenseWeight) and w.type_name == "Q4_K (held as BF16)"
    assert torch.equal(w.tensor, torch.from_numpy(gguf_file.dequantize("Q4_K")).to(torch.bfloat16))


@pytest.mark.parametrize("scheme, kind", [("int8", Q.Q8_0), ("int4", Q.Q4_1)])
def test_quantize_writes_the_gguf_quantizers_bytes(scheme, kind):
    weight = torch.randn(70, 320, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[5, 32:64] = 0.0  # an all-zero group: scale 0
    weight[6, :32] = 1.0  # a constant group: max == min
    w = quantized(weight, scheme)
    expected = gguf.quants.quantize(weight.numpy(), kind)
    assert isinstance(w, QuantWeight) and w.type_name == kind.name
    assert np.array_equal(w.file_bytes().numpy(), expected)
    assert w.resident_bytes == expected.nbytes


def test_quantize_goes_a_chunk_of_rows_at_a_time(monkeypatch):
    weight = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    whole = quantize_rows(weight, Q.Q4_1)
    monkeypatch.setattr("lanes.quant.quantize.CHUNK", 3)
    assert torch.equal(quantize_rows(weight, Q.Q4_1), whole)


def test_rows_move_as_bytes(gguf_file):
    tensor = gguf_file.tensors["Q4_K"]
    w = from_gguf(tensor.data, tensor.tensor_type, (48, 512), torch.float32)
    index = torch.randperm(48, generator=torch.Generator().manual_seed(0))[:20]
    picked = w.rows(index)
    assert picked.shape == (20, 512) and picked.resident_bytes == 20 * 2 * 144
    assert torch.equal(picked.dequantize(), w.dequantize()[index])


def test_stacking_one_format_makes_one_weight_and_mixed_ones_a_stack(gguf_file):
    def weight(name):
        tensor = gguf_file.tensors[name]
        return from_gguf(tensor.data, tensor.tensor_type, (48, 512), torch.float32)

    q, k, v = weight("Q4_1"), weight("Q4_1").rows(torch.arange(16)), weight("Q6_K")
    fused = stack_rows([q, k])
    assert isinstance(fused, QuantWeight) and fused.shape == (64, 512)
    assert torch.equal(fused.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    mixed = stack_rows([q, k, v])
    assert isinstance(mixed, StackedWeight) and mixed.shape == (112, 512) and mixed.type_name == "Q4_1+Q6_K"  # neighbours of one format fused
    assert mixed.resident_bytes == q.resident_bytes + k.resident_bytes + v.resident_bytes
    x = torch.randn(3, 512)
    assert torch.equal(mixed.matmul(x), torch.cat([q.matmul(x), k.matmul(x), v.matmul(x)], -1))
    dense = stack_rows([DenseWeight(torch.ones(2, 512)), DenseWeight(torch.zeros(3, 512))])
    assert isinstance(dense, DenseWeight) and dense.shape == (5, 512)
    with pytest.raises(ValueError, match="one input width"):
        stack_rows([q, DenseWeight(torch.ones(2, 256))])
