"""A GGUF file's metadata as the config.json its Hugging Face folder would have, for the architectures
llama.cpp's converter writes: llama (and Mixtral, a llama with experts), qwen2, qwen3, qwen2moe, qwen3moe
and glm4moe. Shapes are confirmed against the tensors when they are read.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .errors import CheckpointError
from .gguf_file import GGUFFile

ARCHITECTURES = {  # GGUF architecture -> (model_type, Hugging Face architecture)
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM"),
}
SIGMOID_GATING = 2  # gguf.ExpertGatingFuncType.SIGMOID


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
    model_type, architecture = ARCHITECTURES.get(arch, (arch, arch))
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture],
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
    if arch in ("qwen3", "qwen3moe") and "blk.0.attn_q.bias" in file.tensors:
        config["attention_bias"] = True
    if arch == "llama" and get("expert_count"):
        config.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=get("expert_count"),
                      num_experts_per_tok=get("expert_used_count"))
    elif arch in ("qwen2moe", "qwen3moe"):
        _qwen_moe(file, get, config, arch)
    elif arch == "glm4moe":
        _glm4_moe(file, get, config)
    return config


def _qwen_moe(file: GGUFFile, get: Callable[..., Any], config: dict[str, Any], arch: str) -> None:
    layers = int(config["num_hidden_layers"])
    config.update(
        num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
        moe_intermediate_size=get("expert_feed_forward_length"),
        # llama.cpp renormalises Qwen3-MoE's top k and not Qwen2-MoE's, unless the file says otherwise
        norm_topk_prob=bool(get("expert_weights_norm", arch == "qwen3moe")),
        mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in file.tensors],
    )
    if arch == "qwen2moe":
        config.update(shared_expert_intermediate_size=get("expert_shared_feed_forward_length"),
                      qkv_bias="blk.0.attn_q.bias" in file.tensors)


def _glm4_moe(file: GGUFFile, get: Callable[..., Any], config: dict[str, Any]) -> None:
    if get("expert_gating_func", SIGMOID_GATING) != SIGMOID_GATING:
        raise CheckpointError(file.path, "a glm4moe file whose experts are not gated by a sigmoid")
    head_dim = int(config["head_dim"])
    config.update(
        # the block count includes the multi-token-prediction layers, which are not read
        num_hidden_layers=int(config["num_hidden_layers"]) - int(get("nextn_predict_layers", 0)),
        n_routed_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
        moe_intermediate_size=get("expert_feed_forward_length"), n_shared_experts=get("expert_shared_count", 0),
        first_k_dense_replace=get("leading_dense_block_count", 0), routed_scaling_factor=get("expert_weights_scale", 1.0),
        norm_topk_prob=bool(get("expert_weights_norm", True)), n_group=get("expert_group_count", 1),
        topk_group=get("expert_group_used_count", 1), attention_bias="blk.0.attn_q.bias" in file.tensors,
        use_qk_norm="blk.0.attn_q_norm.weight" in file.tensors,
    )
    config["rope_parameters"]["partial_rotary_factor"] = int(get("rope.dimension_count", head_dim // 2)) / head_dim


def _rope(file: GGUFFile, get: Callable[..., Any]) -> dict[str, Any]:
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
