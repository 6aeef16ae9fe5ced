"""Quantized weights kept quantized through the loader: tiny GGUF files of each block format, and
`--quantize int8|int4` of a Hugging Face folder, loaded and run against transformers over the weights the
`gguf` package dequantizes (its GGUF loader, or its quantizer and dequantizer on the folder's weights).

Rules: tiny random models; fp32 on the CPU. Our kernels decode every value exactly as the gguf package
does; Q8_0, Q4_0 and Q4_1 multiply activations rounded to 8 bits a group of 32 (as llama.cpp does), so
their reference rounds each linear's input the same way (int8_reference.py). The bound left is fp32
accumulation's: logits within 1e-4, identical greedy tokens. Resident weight memory is the file's tensor bytes (within 10%). Skipped without AVX-512 (the
kernels' only target); without them weights are dequantized, which test_gguf.py covers.
"""

import argparse
import threading

import gguf
import numpy as np
import pytest
import torch

import scenario
import tiny
import tiny_gguf
from int8_reference import assert_same_in_8_bits
from lanes.core.blocks import BlockPool
from lanes.families.weights import Shard
from lanes.gpu.collective import ThreadGroup
from lanes.gpu.device import choose
from lanes.loader import QuantizeRefused, load_model
from lanes.quant import unavailable_reason

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the kernels need AVX-512")
K_QUANTS = {Q.Q4_K, Q.Q5_K, Q.Q6_K}  # the gguf package cannot quantize these: random blocks with small scales


@pytest.fixture(autouse=True)
def kernels():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"the quantized kernels cannot be built here: {reason}")


def file_tensor_bytes(path) -> int:
    return sum(t.n_bytes for t in gguf.GGUFReader(path).tensors)


def write_file(tmp_path, kind: Q, arch: str = "llama", **overrides):
    """A tiny model as a GGUF file whose matrices are all `kind` (256-wide rows for the K-quants' blocks)."""
    size = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4) if kind in K_QUANTS else {}
    source = tiny.build(arch, tmp_path / "hf", **{**size, **overrides})
    path = tmp_path / f"tiny-{kind.name}.gguf"
    encode = None
    if kind in K_QUANTS:
        seeds = iter(range(1000))
        encode = lambda name, rows: tiny_gguf.random_k_blocks(*rows.shape, kind, scale=2e-4, seed=next(seeds))
    tiny_gguf.write(source, tmp_path / "hf", path, arch, kind, encode)
    return path


def run_scenario(model, steps: int = 8):
    pool = BlockPool(model.kv_blocks)
    prompt_ids = scenario.prompts(model.config.vocab_size)
    out = scenario.run(model.decoder, pool, prompt_ids, steps=steps)
    pool.check_integrity()
    return prompt_ids, out


def assert_same(ours, theirs, atol: float, rtol: float = 0) -> None:
    for mine, ref in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        torch.testing.assert_close(mine, ref, rtol=rtol, atol=atol)
    assert ours[2] == theirs[2]


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda k: k.name)
def test_each_type_stays_quantized_and_equals_the_dequantized_reference(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_file(tmp_path, kind, num_key_value_heads=2, tie_word_embeddings=kind == Q.Q4_1)
    model = load_model(path, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    census = model.weights_census()
    matrices = 4 * model.config.layers + 1 + (not model.config.tie_embeddings)  # q/k/v and gate/up fused, o, down a layer
    assert census.tensors == {kind.name: matrices, "F32": 2 * model.config.layers + 1}
    assert abs(census.resident_bytes - file_tensor_bytes(path)) <= 0.1 * file_tensor_bytes(path)
    assert census.resident_bytes == file_tensor_bytes(path)  # the bytes themselves, not a copy beside them
    # in float64, so the bound measures our fp32 sums alone, not also the reference's (whose order varies by CPU)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float64).eval()
    prompt_ids, ours = run_scenario(model)
    if kind not in K_QUANTS:
        assert_same_in_8_bits(ours, reference, prompt_ids)
        return
    theirs = scenario.reference(reference, prompt_ids, ours[2], steps=8)
    # random K-quant blocks give logits up to ~30: fp32 sums' error grows with their scale (1e-5 of it)
    scale = max(ref.abs().max().item() for ref in theirs[0] + theirs[1])
    assert_same(ours, theirs, atol=max(1e-4, 1e-5 * scale), rtol=1e-4)


def test_mixed_types_in_one_layer_are_stacked_side_by_side(tmp_path):
    from transformers import AutoModelForCausalLM

    types = {"self_attn.v_proj": Q.Q8_0, "mlp.up_proj": Q.Q8_0}  # llama.cpp's Q4_K_M mixes types like this
    source = tiny.build("llama", tmp_path / "hf", num_key_value_heads=2)
    path = tmp_path / "mixed.gguf"
    write_mixed(source, tmp_path / "hf", path, types)
    model = load_model(path, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    layers = model.config.layers  # q and k fused, v beside them; gate and up side by side
    assert model.weights_census().tensors == {"Q4_1": 4 * layers + 2, "Q8_0": 2 * layers, "F32": 2 * layers + 1}
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float64).eval()
    prompt_ids, ours = run_scenario(model)
    assert_same_in_8_bits(ours, reference, prompt_ids)


def write_mixed(source, folder, path, types) -> None:
    """As tiny_gguf.write, each matrix in Q4_1 but those `types` names (by a part of their name)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    tiny_gguf._header(writer, source.config, folder)
    heads, kv_heads = source.config.num_attention_heads, source.config.num_key_value_heads
    for name, tensor in source.state_dict().items():
        array = tensor.detach().to(torch.float32).numpy()
        if ".q_proj." in name:
            array = tiny_gguf.llama_cpp_permute(array, heads)
        elif ".k_proj." in name:
            array = tiny_gguf.llama_cpp_permute(array, kv_heads)
        if array.ndim == 2:
            kind = next((t for part, t in types.items() if part in name), Q.Q4_1)
            writer.add_tensor(tiny_gguf.gguf_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(tiny_gguf.gguf_name(name), np.ascontiguousarray(array))
    tiny_gguf._finish(writer)


def run_ranks(path, world: int, prompt_ids, **options):
    """Each rank of `world` as a thread over a ThreadGroup: its scenario's outputs."""
    group = ThreadGroup(world, timeout=120)
    results: list = [None] * world
    errors: list = []

    def rank_main(rank: int) -> None:
        try:
            model = load_model(path, choose("cpu", "fp32"), shard=Shard(rank, world), comm=group.member(rank),
                               kv_blocks=64, quiet=True, **options)
            pool = BlockPool(model.kv_blocks)
            results[rank] = scenario.run(model.decoder, pool, prompt_ids, steps=8)
            pool.check_integrity()
            results[rank] = (*results[rank], model.weights_census())
        except BaseException as error:  # reported on the test's thread
            errors.append(error)
            group._barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_two_ranks_of_a_quantized_file_equal_one(tmp_path):
    # a vocabulary padded per rank; each rank's column slices whole groups of 32 (a slice that cuts a group
    # is read dequantized, and multiplies activations in full precision: tp 2 would differ by their rounding)
    path = write_file(tmp_path, Q.Q4_1, num_key_value_heads=2, vocab_size=271, intermediate_size=128)
    solo = load_model(path, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    prompt_ids, alone = run_scenario(solo)
    for *sharded, census in run_ranks(path, 2, prompt_ids):
        assert set(census.tensors) == {"Q4_1", "F32"}  # row- and column-parallel slices cut as bytes
        assert census.bytes["Q4_1"] < 0.6 * solo.weights_census().bytes["Q4_1"]
        assert_same(sharded, alone, atol=1e-5)


def quantized_reference(source, scheme: str):
    """`source` (a transformers model) with every matrix replaced by the gguf package's quantization of it,
    dequantized: what `--quantize` keeps, as the gguf package computes it."""
    kind = {"int8": Q.Q8_0, "int4": Q.Q4_1}[scheme]
    with torch.no_grad():
        for name, param in source.named_parameters():
            if param.ndim == 2:
                rows = param.detach().numpy()
                param.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(rows, kind), kind)))
    return source


@pytest.mark.parametrize("scheme, kind", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_quantize_keeps_a_folder_quantized_and_equals_the_gguf_quantizer(scheme, kind, tmp_path):
    source = tiny.build("qwen2", tmp_path, num_key_value_heads=2)  # q/k/v biases stay full precision
    model = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=64, quiet=True, quantize=scheme)
    census = model.weights_census()
    assert census.tensors[kind] == 4 * model.config.layers + 2  # the embedding and the head too
    full = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=64, quiet=True).weights_census()
    assert census.resident_bytes < (0.3 if scheme == "int8" else 0.2) * full.resident_bytes
    prompt_ids, ours = run_scenario(model)
    assert_same_in_8_bits(ours, quantized_reference(source, scheme).double(), prompt_ids)


def test_quantize_with_two_ranks_equals_one(tmp_path):  # each rank's slices are whole groups of 32
    tiny.build("llama", tmp_path, num_key_value_heads=2, vocab_size=271, tie_word_embeddings=True, intermediate_size=128)
    solo = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=64, quiet=True, quantize="int4")
    prompt_ids, alone = run_scenario(solo)
    for *sharded, census in run_ranks(tmp_path, 2, prompt_ids, quantize="int4"):
        assert census.tensors["Q4_1"] == 4 * solo.config.layers + 1  # the tied head is the embedding
        assert_same(sharded, alone, atol=1e-5)


def test_quantize_refuses_what_it_cannot_do(tmp_path):
    path = write_file(tmp_path, Q.Q8_0)
    with pytest.raises(QuantizeRefused, match="^--quantize is for full-precision checkpoints; a GGUF file's weights keep their own types$"):
        load_model(path, choose("cpu", "fp32"), kv_blocks=4, quiet=True, quantize="int8")
    with pytest.raises(QuantizeRefused, match="^--quantize takes int8 or int4, not 'int3'$"):
        load_model(tmp_path / "hf", choose("cpu", "fp32"), kv_blocks=4, quiet=True, quantize="int3")


def test_serve_refuses_a_bad_quantize_value(capsys):
    from lanes.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["serve", "--quantize", "int3"])
    assert exit.value.code == 2
    assert "argument --quantize: invalid choice: 'int3' (choose from 'int8', 'int4')" in capsys.readouterr().err


def test_info_reports_each_weights_type_and_the_resident_bytes(tmp_path):
    from lanes.flags import add_serve_flags
    from lanes.serve import build_service

    path = write_file(tmp_path, Q.Q4_1, tie_word_embeddings=True)
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    service = build_service(parser.parse_args(["--model", str(path), "--lanes", "2", "--max-model-len", "64"]))
    weights = service.info()["weights"]
    layers = 2  # tiny.build's
    assert weights["types"]["Q4_1"]["tensors"] == 4 * layers + 1 and weights["types"]["F32"]["tensors"] == 2 * layers + 1
    assert weights["resident_bytes"] == sum(t["bytes"] for t in weights["types"].values()) == file_tensor_bytes(path)
