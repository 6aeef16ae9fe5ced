"""Tiny GGUF files written in tests with the gguf package's writer, from a transformers model's weights,
laid out as llama.cpp's converter lays them out (names, the llama Q/K row permutation, quantized matrices;
for MoE models each layer's experts stacked into 3-D tensors, named by the gguf package's own tensor map).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from safetensors import safe_open

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
    _header(writer, config, folder)
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
        _add(writer, gguf_name(name), array, matrix_type)
    _finish(writer)


def _header(writer: gguf.GGUFWriter, config, folder: Path, block_count: int | None = None) -> None:
    """The model's shape and its tokenizer (from `folder`), as the converter writes them."""
    writer.add_block_count(block_count or config.num_hidden_layers)
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


def _add(writer: gguf.GGUFWriter, name: str, array: np.ndarray, matrix_type: gguf.GGMLQuantizationType) -> None:
    """Matrices (2-D, and stacked experts) in `matrix_type`, vectors in float32, as the converter stores them."""
    if array.ndim >= 2 and matrix_type != gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, gguf.quants.quantize(array, matrix_type), raw_dtype=matrix_type)
    else:
        writer.add_tensor(name, np.ascontiguousarray(array))


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


MOE_ARCHES = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
              "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE, "mixtral": gguf.MODEL_ARCH.LLAMA}
_EXPERT = re.compile(r"(model\.layers\.\d+\..*experts)\.(\d+)\.(\w+)\.weight$")


def write_moe(config, folder: Path, path: Path, matrix_type: gguf.GGMLQuantizationType) -> None:
    """Write the MoE model saved in `folder` (its safetensors and tokenizer; `config` its transformers config)
    as llama.cpp's converter would: each layer's experts stacked [experts, rows, cols] under their merged
    name, every name through the gguf package's tensor map, the MoE metadata of the architecture; for
    GLM also a multi-token-prediction layer past the last, which a reader must leave alone."""
    kind = config.model_type
    arch = MOE_ARCHES[kind]
    mtp = kind == "glm4_moe"
    blocks = config.num_hidden_layers + mtp
    names = gguf.get_tensor_name_map(arch, blocks)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _header(writer, config, folder, blocks)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", None) or config.num_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if kind != "mixtral":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if kind == "glm4_moe":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_nextn_predict_layers(1)
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in f.keys():
            array = f.get_tensor(name).to(torch.float32).numpy()
            if (match := _EXPERT.match(name)) is not None:
                stacks.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = array
                continue
            if kind == "mixtral" and (".q_proj." in name or ".k_proj." in name):
                array = llama_cpp_permute(array, config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads)
            if name.endswith("e_score_correction_bias"):  # the converter's rename before the map
                name = name.removesuffix("_bias") + ".bias"
            base, suffix = name.rsplit(".", 1)
            if base.endswith("shared_expert_gate"):
                array = array.reshape(-1)  # stored as a vector
            router = base.endswith(".gate") and array.shape[0] == experts  # the converter keeps routers in float32
            _add(writer, f"{names.get_name(base)}.{suffix}", array, gguf.GGMLQuantizationType.F32 if router else matrix_type)
    for (stem, proj), each in stacks.items():
        _add(writer, f"{names.get_name(f'{stem}.{proj}')}.weight", np.stack([each[e] for e in range(len(each))]), matrix_type)
    if mtp:  # llama.cpp's converter writes GLM's MTP layer as one more block
        hidden = config.hidden_size
        writer.add_tensor(f"blk.{config.num_hidden_layers}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{config.num_hidden_layers}.nextn.eh_proj.weight", np.zeros((hidden, 2 * hidden), np.float32))
    _finish(writer)


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
