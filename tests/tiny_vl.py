"""Tiny Qwen2-VL and Qwen2.5-VL checkpoints built in tests: transformers' models from small configs, random
weights, saved with a byte-level tokenizer that has the vision placeholders, and Qwen2-VL's chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

import tiny

VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen2-VL-2B-Instruct's chat template as published with the checkpoint.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 2]})
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, mlp_ratio=2, patch_size=14,
                     temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
    "qwen2_5_vl": dict(depth=2, hidden_size=32, out_hidden_size=48, intermediate_size=40, num_heads=4, patch_size=14,
                       temporal_patch_size=2, spatial_merge_size=2, in_channels=3, window_size=56,
                       fullatt_block_indexes=[1], tokens_per_second=2),
}


def write_vl_tokenizer(folder: Path, labels: bool = False) -> dict[str, int]:
    """tiny's tokenizer plus the vision placeholders as special tokens; returns their ids (and the size).
    `labels` gives it single-token decision labels, as tiny's does."""
    size = tiny.write_tokenizer(folder, chat_template=QWEN2_VL_TEMPLATE, labels=labels)
    path = folder / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_special_tokens(VISION_SPECIALS)
    tokenizer.save(str(path))
    ids = {name: tokenizer.token_to_id(name) for name in VISION_SPECIALS}
    ids["size"] = size + len(VISION_SPECIALS)
    return ids


def build(family: str, folder: Path, seed: int = 0, labels: bool = False):
    """A tiny `family` model (qwen2_vl or qwen2_5_vl) saved to `folder`; returns (model, placeholder ids).
    `labels` makes decision labels single tokens (see `write_vl_tokenizer`)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    ids = write_vl_tokenizer(folder, labels=labels)
    config_class, model_class = {
        "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    }[family]
    text = dict(TEXT, vocab_size=ids["size"] + 4, bos_token_id=0, eos_token_id=1)
    config = config_class(vision_config=VISION[family], text_config=text, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"], bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    tiny.randomize(model, seed=seed + 1)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 64}))
    return model, ids
