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


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random (biases and norms too, which transformers would start at 0 and 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.15
            param.copy_(1.0 + noise if "norm" in name else noise)


def build(kind: str, folder: Path, seed: int = 0, labels: bool = False, **overrides):
    """A transformers model of family `kind` (llama, qwen2, qwen3) saved with a tokenizer; returns the model."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder, labels=labels)
    base = dict(vocab_size=vocab + 6, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    base.update(overrides)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = model_class(config_class(**base)).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model
