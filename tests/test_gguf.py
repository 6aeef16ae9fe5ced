"""GGUF checkpoints: tiny models written in the test with the gguf writer (F32, Q8_0, Q4_1 matrices; the
llama Q/K permutation), loaded by us and by transformers' GGUF loader, and compared.

Rules: tiny random models; fp32 on the CPU; logits within 1e-4 of transformers reading the same file
(for Q8_0 and Q4_1, with each linear's input rounded to 8 bits as our integer kernels round it:
int8_reference.py).
"""

import gguf
import numpy as np
import pytest
import torch

import scenario
import tiny
import tiny_gguf
from int8_reference import assert_equals_transformers_in_8_bits
from lanes.checkpoint.gguf_source import unpermute
from lanes.core.blocks import BlockPool
from lanes.gpu.device import choose
from lanes.loader import load_model

Q = gguf.GGMLQuantizationType


def test_unpermute_inverts_llama_cpp_permute():
    weight = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    permuted = tiny_gguf.llama_cpp_permute(weight, 8)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute(torch.from_numpy(permuted), 8).numpy(), weight)


@pytest.mark.parametrize(
    "arch, matrix_type, overrides",
    [
        ("llama", Q.Q4_1, dict(num_key_value_heads=2)),
        ("llama", Q.Q8_0, dict(num_key_value_heads=4, tie_word_embeddings=True)),
        ("qwen2", Q.Q8_0, dict(num_key_value_heads=2)),
        ("qwen3", Q.F32, dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)),  # transformers reads no key_length
    ],
)
def test_gguf_equals_transformers_gguf_loader(arch, matrix_type, overrides, tmp_path):
    from transformers import AutoModelForCausalLM

    source = tiny.build(arch, tmp_path / "hf", hidden_size=64, intermediate_size=128, **overrides)
    path = tmp_path / f"tiny-{arch}-{matrix_type.name}.gguf"
    tiny_gguf.write(source, tmp_path / "hf", path, arch, matrix_type)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float64).eval()
    if matrix_type != Q.F32:  # quantized: our weights are the dequantized ones, not the originals
        assert not torch.equal(reference.model.layers[0].mlp.up_proj.weight, source.model.layers[0].mlp.up_proj.weight.double())
    model = load_model(path, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    assert model.config.family == arch
    if matrix_type != Q.F32:  # Q8_0 and Q4_1 multiply activations rounded to 8 bits
        assert_equals_transformers_in_8_bits(model, reference)
        return
    scenario.assert_equals_transformers(model, reference)


MOE_CASES = {  # fp32 files against transformers on the folder the file was written from
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
    "qwen2_moe": dict(num_key_value_heads=1),
    "mixtral": dict(num_key_value_heads=2),  # llama architecture: Q/K rows permuted
    "glm4_moe": dict(num_hidden_layers=3, attention_bias=True, routed_scaling_factor=1.5),
}


@pytest.mark.parametrize("kind", sorted(MOE_CASES))
def test_moe_gguf_with_stacked_experts_equals_its_hugging_face_folder(kind, tmp_path):
    """llama.cpp's layout (experts stacked, names from the gguf package's map, GLM's MTP block past the
    last layer) read back equals transformers on the weights the file was written from."""
    source = tiny.build(kind, tmp_path / "hf", **MOE_CASES[kind])
    path = tmp_path / f"tiny-{kind}.gguf"
    tiny_gguf.write_moe(source.config, tmp_path / "hf", path, Q.F32)
    stacked = [t for t in gguf.GGUFReader(path).tensors if t.name.endswith("_exps.weight")]
    assert stacked and all(len(t.shape) == 3 for t in stacked)
    model = load_model(path, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    assert model.config.family == kind and model.config.layers == source.config.num_hidden_layers
    scenario.assert_equals_transformers(model, source)


def test_quantized_qwen3_moe_gguf_equals_transformers_gguf_loader(tmp_path):
    """Q8_0 experts and attention (routers in float32, as the converter keeps them), against transformers'
    own GGUF loader reading the same file. Its GGUF mapping reads no expert_feed_forward_length, so the
    experts here have its default size, 768."""
    from transformers import AutoModelForCausalLM

    source = tiny.build("qwen3_moe", tmp_path / "hf", num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                        moe_intermediate_size=768)
    path = tmp_path / "tiny-qwen3_moe-Q8_0.gguf"
    tiny_gguf.write_moe(source.config, tmp_path / "hf", path, Q.Q8_0)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    assert not torch.equal(reference.model.layers[0].mlp.experts.down_proj, source.model.layers[0].mlp.experts.down_proj)
    model = load_model(path, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    assert_equals_transformers_in_8_bits(model, reference)


def test_without_the_kernels_a_quantized_file_is_dequantized_and_says_so(tmp_path, monkeypatch):
    import io

    import lanes.quant.build
    import lanes.quant.native

    monkeypatch.setattr(lanes.quant.native, "built", lambda: False)
    monkeypatch.setattr(lanes.quant.native, "unavailable_reason", lambda: "this CPU has no AVX-512")
    monkeypatch.setattr(lanes.quant.build, "unavailable_reason", lambda: "this CPU has no AVX-512")
    source = tiny.build("llama", tmp_path / "hf", hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write(source, tmp_path / "hf", path, "llama", Q.Q8_0)
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    model = load_model(path, choose("cpu", "fp32"), kv_blocks=64)
    assert "GGUF weights are dequantized at load: this CPU has no AVX-512\n" in stream.getvalue()
    assert "loading tiny.gguf (dequantizing to fp32)" in stream.getvalue()
    layers = model.config.layers
    assert model.weights_census().tensors == {"Q8_0 (held as F32)": 4 * layers + 1, "F32": 2 * layers + 1}


def test_dequantize_reads_the_blocks_as_fp32_tensors_that_equal_transformers_gguf_loader(tmp_path, monkeypatch):
    import io

    from transformers import AutoModelForCausalLM

    source = tiny.build("llama", tmp_path / "hf", hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write(source, tmp_path / "hf", path, "llama", Q.Q4_1)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float64).eval()
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    model = load_model(path, choose("cpu", "fp32"), kv_blocks=64, dequantize=True)
    assert "loading tiny.gguf (dequantizing to fp32)" in stream.getvalue()
    layers = model.config.layers
    assert model.weights_census().tensors == {"Q4_1 (held as F32)": 4 * layers + 1, "F32": 2 * layers + 1}
    scenario.assert_equals_transformers(model, reference)  # fp32 activations: no 8-bit rounding in the products
