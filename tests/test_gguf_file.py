"""`GGUFFile`, our reader of a GGUF header, against the gguf package's `GGUFReader` (the reference): the same
metadata values and types, the same tensors (type, shape, dtype, bytes), and a clear fault for a cut file.

Rules: files written in tmp_path by the gguf package's writer; no model, no network.
"""

import gguf
import numpy as np
import pytest

from lanes.checkpoint.errors import CheckpointError
from lanes.checkpoint.gguf_file import GGUFFile

Q = gguf.GGMLQuantizationType


def written(path, alignment: int | None = None):
    """A file with every scalar value type, arrays of numbers, strings and bools, and tensors of float,
    integer and block types (odd shapes, so that alignment pads between them)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.text", "héllo ▁ world")
    writer.add_string("t.empty", "")
    writer.add_array("t.tokens", ["<s>", "a b", "▁x", "", "日本"])
    writer.add_array("t.ints", [3, -1, 7])
    writer.add_array("t.floats", [0.5, -2.25, 1e-3])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nothing", [])
    writer.add_token_list(["<s>", "hi", "▁there"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    writer.add_tensor("i32", rng.integers(-9, 9, (2, 3)).astype(np.int32))
    raw = rng.integers(0, 256, (4, 2 * 34), dtype=np.uint8)  # two Q8_0 blocks a row
    raw[:, 0:2] = raw[:, 34:36] = np.full((4, 1), 1e-2, np.float16).view(np.uint8)
    writer.add_tensor("q8", raw, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_metadata_and_tensors_are_the_gguf_readers(tmp_path, alignment):
    path = written(tmp_path / "m.gguf", alignment)
    reference = gguf.GGUFReader(path)
    ours = GGUFFile(path)
    expected = {key: field.contents() for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in ours.metadata[key]] == [type(v) for v in value], key
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for theirs in reference.tensors:
        tensor = ours.tensors[theirs.name]
        assert tensor.tensor_type == theirs.tensor_type and tensor.shape == tuple(theirs.shape.tolist())
        assert tensor.data.dtype == theirs.data.dtype and tensor.data.shape == theirs.data.shape
        assert tensor.n_bytes == theirs.n_bytes and np.array_equal(tensor.data, theirs.data)
        if theirs.tensor_type != Q.I32:  # the gguf package dequantizes no integer type
            assert np.array_equal(ours.dequantize(theirs.name), gguf.quants.dequantize(theirs.data, theirs.tensor_type)
                                  .reshape(ours.shape(theirs.name)))


@pytest.mark.parametrize("keep", [3, 10, 40, 200, -40])  # -40: inside the last tensor, past its padding
def test_a_cut_file_is_a_checkpoint_error_naming_it(tmp_path, keep):
    whole = written(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    with pytest.raises(CheckpointError, match="truncated or corrupt GGUF file") as error:
        GGUFFile(cut)
    assert str(cut) in str(error.value)


def test_a_released_file_drops_its_tensors_and_vocabulary_and_keeps_the_rest(tmp_path):
    file = GGUFFile(written(tmp_path / "m.gguf"))
    assert file.metadata["tokenizer.ggml.tokens"] == ["<s>", "hi", "▁there"]
    file.release()
    assert file.tensors == {} and "tokenizer.ggml.tokens" not in file.metadata
    assert file.architecture == "llama" and file.metadata["t.tokens"][4] == "日本"
