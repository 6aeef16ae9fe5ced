"""A GGUF file seen as a Hugging Face checkpoint: its metadata as a config.json, its tensors under HF names.

Tensors are dequantized one at a time with the gguf package. llama.cpp stores the Q and K rows of the
`llama` architecture permuted for its interleaved RoPE; reading undoes that, so the rows are in the
half-split order of Hugging Face checkpoints.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError
from .gguf_file import GGUFFile

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED = {"llama"}  # convert_hf_to_gguf permutes q/k only for these

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors the families do not read."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _BLOCK.match(gguf_name)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}.{match.group(3)}"
    return None


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """A config.json equivalent built from the GGUF metadata (the shapes the tensors confirm at load)."""
    arch = file.architecture
    meta = file.metadata

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    if get("block_count") is None:
        raise CheckpointError(file.path, f"metadata has no {arch}.block_count")
    vocab = file.shape("token_embd.weight")[0] if "token_embd.weight" in file.tensors else get("vocab_size")
    heads = int(get("attention.head_count", 0))
    hidden = int(get("embedding_length", 0))
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [ARCHITECTURES.get(arch, arch)],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or (hidden // heads if heads else None),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": get("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "rope_parameters": _rope(file, get),
    }
    if arch == "qwen3" and "blk.0.attn_q.bias" in file.tensors:
        config["attention_bias"] = True
    return config


def _rope(file: GGUFFile, get) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": float(get("rope.freq_base", 10000.0)), "rope_type": "default"}
    kind = get("rope.scaling.type", "none")
    factor = get("rope.scaling.factor")
    if kind == "linear" and factor:
        rope.update(rope_type="linear", factor=float(factor))
    elif kind == "yarn":
        original = get("rope.scaling.original_context_length")
        rope.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=original)
    elif kind not in ("none", "linear"):
        raise CheckpointError(file.path, f"RoPE scaling {kind!r} is not supported")
    if "rope_freqs.weight" in file.tensors:
        # llama3-style scaling is stored as per-frequency divisors rather than as parameters.
        factors = file.dequantize("rope_freqs.weight").astype(np.float64).tolist()
        rope.update(rope_type="freq_factors", freq_factors=tuple(factors))
    return rope


class GGUFSource:
    """The tensors of a GGUF file under Hugging Face names, dequantized to float32 one at a time."""

    def __init__(self, file: GGUFFile, config: dict[str, Any]) -> None:
        self.file = file
        self.path = file.path
        self._gguf_name = {hf: g for g in file.tensors if (hf := hf_name(g)) is not None}
        self._permute = file.architecture in PERMUTED
        self._heads = int(config["num_attention_heads"])
        self._kv_heads = int(config["num_key_value_heads"])

    def names(self) -> list[str]:
        return list(self._gguf_name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.shape(self._gguf_name[name])

    def get(self, name: str, *, dim: int | None = None, rank: int = 0, world: int = 1) -> torch.Tensor:
        array = self.file.dequantize(self._gguf_name[name])
        # F32 tensors come back as read-only views of the mapped file; torch needs memory it may own.
        tensor = torch.from_numpy(array if array.flags.writeable and array.flags.c_contiguous else array.copy())
        if self._permute and ".self_attn.q_proj." in name:
            tensor = unpermute(tensor, self._heads)
        elif self._permute and ".self_attn.k_proj." in name:
            tensor = unpermute(tensor, self._kv_heads)
        if dim is None or world == 1:
            return tensor
        return tensor.chunk(world, dim=dim)[rank].contiguous()


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`: each head's rows go from interleaved pairs back to two halves."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
