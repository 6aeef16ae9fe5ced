"""Bad checkpoints end in one clear line naming the file and the fault, never a traceback.

Rules: tiny checkpoints built in the test and then broken; each fault checked at the loader (the typed
error) and through `python -m lanes generate` (exit 2, one line on stderr).
"""

import json
import subprocess
import sys

import gguf
import pytest

import tiny
import tiny_gguf
from lanes.checkpoint.errors import CheckpointError
from lanes.gpu.device import choose
from lanes.loader import load_model


def truncate(path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def break_checkpoint(fault: str, tmp_path):
    """Build a good checkpoint, break it one way; returns (path to load, the file named, words of the fault)."""
    folder = tmp_path / "model"
    model = tiny.build("llama", folder)
    config = folder / "config.json"
    if fault == "missing-config":
        config.unlink()
        return folder, config, "missing: a Hugging Face model folder needs config.json"
    if fault == "corrupt-config":
        config.write_text('{"model_type": "llama", "hidden_size": ')
        return folder, config, "not valid JSON"
    if fault == "unknown-architecture":
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
        return folder, config, "unknown architecture 'mamba' (supported families: glm4_moe, llama, mixtral, qwen2, qwen2_5_vl, qwen2_moe, qwen2_vl, qwen3, qwen3_moe)"
    if fault == "truncated-safetensors":
        truncate(folder / "model.safetensors", 0.6)
        return folder, folder / "model.safetensors", "truncated or corrupt safetensors file"
    if fault == "missing-tensor":
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder, folder, "missing tensor 'model.layers.1.mlp.up_proj.weight'"
    if fault == "truncated-gguf":
        path = tmp_path / "tiny.gguf"
        tiny_gguf.write(model, folder, path, "llama", gguf.GGMLQuantizationType.Q8_0)
        truncate(path, 0.7)
        return path, path, "truncated or corrupt GGUF file"
    if fault == "tokenizer-vocabulary":
        config.write_text(json.dumps({**json.loads(config.read_text()), "vocab_size": 200}))
        return folder, folder / "tokenizer.json", "tokenizer has 268 tokens but the model's vocabulary is 200"
    if fault == "not-a-model":
        path = tmp_path / "notes.txt"
        path.write_text("hello")
        return path, path, "neither a GGUF file nor a Hugging Face model folder"
    raise AssertionError(fault)


FAULTS = ["missing-config", "corrupt-config", "unknown-architecture", "truncated-safetensors", "missing-tensor",
          "truncated-gguf", "tokenizer-vocabulary", "not-a-model"]


@pytest.mark.parametrize("fault", FAULTS)
def test_loader_raises_one_line_naming_file_and_fault(fault, tmp_path):
    path, named, words = break_checkpoint(fault, tmp_path)
    with pytest.raises(CheckpointError) as caught:
        load_model(path, choose("cpu", "fp32"), kv_blocks=4, quiet=True)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{named}: ")
    assert words in message


@pytest.mark.parametrize("fault", ["corrupt-config", "truncated-gguf", "tokenizer-vocabulary"])
def test_cli_prints_one_line_and_exits_2(fault, tmp_path):
    path, named, words = break_checkpoint(fault, tmp_path)
    done = subprocess.run([sys.executable, "-m", "lanes", "generate", "--model", str(path), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [f"lanes: error: {named}: " + lines[0].split(": ", 3)[3]]
    assert words in lines[0]
    assert "Traceback" not in done.stderr
