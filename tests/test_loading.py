"""Loading checkpoints: sharded safetensors folders, GGUF tensors of the types the existing GGUF test leaves
out (F16, BF16, Q4_0, Q4_K, Q6_K), and weights that reach the device one tensor at a time.

Rules: tiny random models built in the test with transformers; references no one here wrote: transformers'
forward (on the same weights) and the gguf package's own `dequantize` of the very bytes in the file; fp32 on
the CPU, logits within 1e-4 (max abs) as in the GGUF test; dequantized tensors equal bit for bit. The gguf
package quantizes F16, BF16 and Q4_0 but not Q4_K or Q6_K (NotImplementedError), so those are written as
random blocks of ggml's layout with small scales, and the package's dequantization of them is the reference.
"""

import shutil
import weakref

import gguf
import numpy as np
import pytest
import torch

import lanes.loader
import scenario
import tiny
import tiny_gguf
from int8_reference import assert_equals_transformers_in_8_bits
from lanes.checkpoint.gguf_source import GGUFSource
from lanes.checkpoint.safetensors_source import SafetensorsSource
from lanes.families.layers import load_decoder, tensor_count
from lanes.families.weights import Shard
from lanes.gpu.device import choose
from lanes.loader import load_model, open_checkpoint

Q = gguf.GGMLQuantizationType


def sharded_folder(tmp_path, kind: str = "qwen2", **overrides):
    """A tiny model saved as several safetensors shards with an index; returns (folder, transformers model)."""
    built = tmp_path / "single"
    reference = tiny.build(kind, built, **overrides)
    folder = tmp_path / "sharded"
    reference.save_pretrained(folder, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(built / name, folder / name)
    return folder, reference


def test_sharded_safetensors_load_and_equal_transformers(tmp_path):
    folder, reference = sharded_folder(tmp_path, num_key_value_heads=1)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) >= 2 and (folder / "model.safetensors.index.json").is_file()
    assert not (folder / "model.safetensors").exists()
    source = SafetensorsSource(folder)
    assert {source.path_of(n).name for n in source.names()} == set(shards)  # every shard holds tensors we read
    assert set(source.names()) == set(reference.state_dict())
    model = load_model(folder, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    assert model.config.family == "qwen2"
    scenario.assert_equals_transformers(model, reference, steps=16)


# ---- GGUF tensor types ----

TYPES = {
    "F16": (Q.F16, None),
    "BF16": (Q.BF16, None),
    "Q4_0": (Q.Q4_0, None),
    "Q4_K": (Q.Q4_K, 2e-4),  # random blocks: the scale of their f16 `d`
    "Q6_K": (Q.Q6_K, 5e-5),
}
K_QUANTS = {Q.Q4_K, Q.Q6_K}


def test_the_gguf_package_cannot_quantize_k_quants():
    rows = np.zeros((1, 256), dtype=np.float32)
    for kind in K_QUANTS:
        with pytest.raises(NotImplementedError):
            gguf.quants.quantize(rows, kind)


CASES = [(t, "llama") for t in sorted(TYPES)] + [("BF16", "qwen3"), ("Q6_K", "qwen3")]  # llama: the Q/K permutation


@pytest.mark.parametrize("type_name, arch", CASES)
def test_gguf_tensor_types_equal_the_packages_dequantization_and_transformers(type_name, arch, tmp_path):
    kind, k_scale = TYPES[type_name]
    # every matrix's rows a whole number of 256-value K blocks; GQA and the llama Q/K permutation on
    model = tiny.build(arch, tmp_path / "hf", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    expected: dict[str, np.ndarray] = {}

    def encode(name: str, rows: np.ndarray) -> np.ndarray:
        if kind in K_QUANTS:
            stored = tiny_gguf.random_k_blocks(*rows.shape, kind, k_scale, seed=len(expected))
        else:
            stored = gguf.quants.quantize(rows, kind)
        expected[name] = gguf.quants.dequantize(stored, kind)  # the reference: the package's own reading
        return stored

    path = tmp_path / f"tiny-{type_name}.gguf"
    tiny_gguf.write(model, tmp_path / "hf", path, arch, kind, encode=encode)
    checkpoint = open_checkpoint(path)
    file_types = {t.tensor_type for t in checkpoint.gguf.tensors.values() if len(t.shape) == 2}
    assert file_types == {kind}
    assert set(expected) == {n for n in checkpoint.source.names() if len(checkpoint.source.shape(n)) == 2}
    for name, reference in expected.items():
        ours = checkpoint.source.get(name)
        assert ours.dtype == torch.float32 and tuple(ours.shape) == reference.shape
        assert torch.equal(ours, torch.from_numpy(reference)), name  # our unpermute and the package agree exactly
    original = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    model.load_state_dict({name: torch.from_numpy(expected[name]) if name in expected else value
                           for name, value in model.state_dict().items()})  # transformers, on the dequantized weights
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, original)  # the reference is the file's, not the original
    loaded = load_model(path, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    assert loaded.config.family == arch
    if kind == Q.Q4_0:  # multiplied in integers, activations rounded to 8 bits a group of 32
        assert_equals_transformers_in_8_bits(loaded, model.double().eval())
    else:
        scenario.assert_equals_transformers(loaded, model.eval())


# ---- one tensor at a time on the host ----

class Recording:
    """A TensorSource around another that records, at every `get`, how many tensors it gave out before are
    still alive (weak references): a loader that converts and places each tensor before the next read keeps 0."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.given: list[weakref.ref] = []
        self.alive_at_get: list[int] = []
        self.elements = 0  # values read onto the host, all gets together

    def names(self):
        return self.inner.names()

    def shape(self, name):
        return self.inner.shape(name)

    def get(self, name, **where):
        self.alive_at_get.append(sum(ref() is not None for ref in self.given))
        tensor = self.inner.get(name, **where)
        self.given.append(weakref.ref(tensor))
        self.elements += tensor.numel()
        return tensor


class ReadsEverythingFirst:
    """A loader's mistake, for the test to catch: every tensor read into host memory before any is placed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.held = {name: inner.get(name) for name in inner.names()}

    def names(self):
        return self.inner.names()

    def shape(self, name):
        return self.inner.shape(name)

    def get(self, name, **where):
        return self.held[name]


@pytest.mark.parametrize("form", ["sharded-safetensors", "gguf"])
def test_weights_reach_the_device_one_tensor_at_a_time_in_the_target_dtype(form, tmp_path, monkeypatch):
    if form == "gguf":
        reference = tiny.build("llama", tmp_path / "hf")
        path = tmp_path / "tiny.gguf"
        tiny_gguf.write(reference, tmp_path / "hf", path, "llama", Q.Q8_0)
        kind, name = GGUFSource, "GGUFSource"
    else:
        path, reference = sharded_folder(tmp_path, "llama")
        kind, name = SafetensorsSource, "SafetensorsSource"
    sources = []

    def recorded(*args):
        sources.append(Recording(kind(*args)))
        return sources[-1]

    monkeypatch.setattr(lanes.loader, name, recorded)
    model = load_model(path, choose("cpu", "bf16"), kv_blocks=8, quiet=True)
    (source,) = sources
    assert len(source.alive_at_get) == tensor_count(model.config)  # each tensor read once
    assert max(source.alive_at_get) == 0  # no host copy outlived its placement on the device
    assert all(ref() is None for ref in source.given)
    weights = model.decoder.weights
    assert weights.embed.dtype == torch.bfloat16 and weights.layers[0].attention.qkv.weight.dtype == torch.bfloat16
    torch.testing.assert_close(weights.layers[1].ffn.down.linear.weight, reference.model.layers[1].mlp.down_proj.weight.bfloat16(),
                               rtol=0, atol=0.02 if form == "gguf" else 0)

    # rank 1 of 2 reads only its half of every split matrix (the vocabulary rows are sliced after the read)
    checkpoint = open_checkpoint(path)
    half = Recording(checkpoint.source)
    load_decoder(checkpoint.config, half, checkpoint.path, shard=Shard(1, 2), device=torch.device("cpu"), dtype=torch.bfloat16)
    whole = {n: np.prod(checkpoint.source.shape(n)) for n in checkpoint.source.names()}
    split = {n for n in whole if len(checkpoint.source.shape(n)) == 2 and "embed" not in n and "lm_head" not in n}
    assert half.elements == sum(v // 2 if n in split else v for n, v in whole.items())
    assert max(half.alive_at_get) == 0

    # the same count on a loader that reads everything first: the check above would fail on it
    eager = Recording(checkpoint.source)
    load_decoder(checkpoint.config, ReadsEverythingFirst(eager), checkpoint.path, shard=Shard(),
                 device=torch.device("cpu"), dtype=torch.bfloat16)
    assert max(eager.alive_at_get) == len(list(checkpoint.source.names())) - 1


def test_a_full_precision_checkpoint_on_the_cpu_builds_the_kernels_at_load_not_in_a_first_request(tmp_path, monkeypatch):
    import io

    import lanes.quant.native

    builds = []  # every CPU pass runs the fp32 kernels: built before the server listens, with its progress step
    monkeypatch.setattr(lanes.quant.native, "built", lambda: bool(builds))
    monkeypatch.setattr(lanes.quant.native, "unavailable_reason", lambda: builds.append(1))
    tiny.build("llama", tmp_path, hidden_size=64, intermediate_size=128)
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    model = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=16)
    assert builds and "building the CPU kernels (once a torch version)" in stream.getvalue()
    assert "in fp32" in stream.getvalue() and model.weights_census().tensors.keys() == {"F32"}
