"""Tiny real checkpoints built in tests: transformers' models from small configs, random weights, saved to folders."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s")]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    return sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))


def _byte_of(char: str) -> int:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if ord(char) in printable:
        return ord(char)
    return sorted(set(range(256)) - set(printable))[ord(char) - 256]


LABEL_MERGES = [("y", "e"), ("ye", "s"), ("n", "o")]  # "yes" and "no" as single tokens, for decisions


def write_tokenizer(folder: Path, chat_template: str = CHATML, labels: bool = False) -> int:
    """A byte-level BPE tokenizer with a few merges and ChatML specials; returns its vocabulary size."""
    merges = MERGES + (LABEL_MERGES if labels else [])
    vocab = {c: i for i, c in enumerate(byte_alphabet())}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    for special in SPECIALS:
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": chat_template})
    )
    return len(vocab)


ROUTER = "mlp.gate.weight"  # every MoE family's router, as transformers names it in memory


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random (biases and norms too, which transformers would start at 0 and 1), routers
    wider so that a token's experts are chosen by clear margins, and GLM's correction bias too (a buffer)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * (0.5 if name.endswith(ROUTER) else 0.15)
            param.copy_(1.0 + noise if "norm" in name else noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)


MOE_BASE = {  # small expert counts and sizes, overridden by each test's config
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                     first_k_dense_replace=1),
}


def build(kind: str, folder: Path, seed: int = 0, labels: bool = False, **overrides):
    """A transformers model of family `kind` (llama, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, glm4_moe)
    built with `from_config` and saved with a tokenizer; returns the model."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder, labels=labels)
    base = dict(vocab_size=vocab + 6, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **MOE_BASE.get(kind, {}))
    base.update(overrides)
    config_class = {
        "llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig, "glm4_moe": transformers.Glm4MoeConfig,
    }[kind]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**base)).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model
