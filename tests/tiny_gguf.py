"""Tiny GGUF files written in tests with the gguf package's writer, from a transformers model's weights,
laid out as llama.cpp's converter lays them out (names, the llama Q/K row permutation, quantized matrices).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` of Q/K rows for its interleaved RoPE."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write(model, folder: Path, path: Path, arch: str, matrix_type: gguf.GGMLQuantizationType,
          encode: Callable[[str, np.ndarray], np.ndarray] | None = None) -> None:
    """Write `model` (saved with its tokenizer in `folder`) as a GGUF file of architecture `arch`.

    With `encode`, each matrix is stored as `encode(hf_name, float32 rows)`: raw `matrix_type` data in
    the model's row order (the llama Q/K permutation is applied to its rows afterwards)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"[PAD{i}]" for i in range(config.vocab_size - len(vocab))]
    specials = {t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().to(torch.float32).numpy()
        if encode is not None and array.ndim == 2:
            stored = encode(name, array)
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                stored = llama_cpp_permute(stored, heads if ".q_proj." in name else kv_heads)  # it moves rows only, so raw rows move as float ones
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(stored), raw_dtype=matrix_type)
            continue
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, kv_heads)
        if array.ndim == 2 and matrix_type != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, matrix_type), raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


K_LAYOUT = {  # bytes a 256-value block, and where its f16 scales lie with their size relative to `scale`
    gguf.GGMLQuantizationType.Q4_K: (144, {0: 1.0, 2: 7.5}),  # d, then dmin (7.5 d centres d*sc*q - dmin*m)
    gguf.GGMLQuantizationType.Q5_K: (176, {0: 1.0, 2: 15.5}),  # as Q4_K, with q up to 31
    gguf.GGMLQuantizationType.Q6_K: (210, {208: 1.0}),  # d, after ql, qh and the int8 scales
}


def random_k_blocks(rows: int, cols: int, kind: gguf.GGMLQuantizationType, scale: float, seed: int) -> np.ndarray:
    """Raw K-quant data (the gguf package cannot quantize these types): random bytes, with every block's
    f16 scales set near `scale` so the values stay small; returns [rows, bytes] uint8."""
    size, scales = K_LAYOUT[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for at, factor in scales.items():
        halves = (factor * scale * rng.uniform(0.5, 1.5, size=(rows, cols // 256))).astype(np.float16)
        blocks[:, :, at : at + 2] = halves.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)
