"""Qwen2-VL and Qwen2.5-VL: a Qwen2 language model with M-RoPE positions, fed by a vision tower.

Hugging Face configs give the text fields at the top level (the hub's) or under `text_config`
(transformers 5 writes it so); the vision tower's fields are under `vision_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from .config import ConfigFault, ModelConfig, decoder_config
from .registry import Family, register

DEFAULT_MROPE_SECTION = (16, 24, 24)  # transformers' default when a config names none


@dataclass(frozen=True)
class VisionTokens:
    """The placeholder tokens a vision prompt uses, and how video frames are spaced in time."""

    image: int
    video: int
    start: int
    end: int
    tokens_per_second: float | None  # Qwen2.5-VL: temporal positions in seconds; Qwen2-VL: None, frame index


def text_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's fields: the top level, overridden by `text_config` where it has them."""
    return {**config, **(config.get("text_config") or {})}


def vl_config(config: Mapping[str, Any], family: str) -> ModelConfig:
    text = text_fields(config)
    if "vision_config" not in config:
        raise ConfigFault(f"a {family} config needs 'vision_config'")
    model = decoder_config(text, family, qkv_bias=True)
    section = tuple(int(n) for n in (model.rope.get("mrope_section") or DEFAULT_MROPE_SECTION))
    if 2 * sum(section) != model.head_dim:
        raise ConfigFault(f"mrope_section {list(section)} does not cover head dimension {model.head_dim}")
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return replace(model, mrope_section=section, tie_embeddings=bool(tie))


def vision_tokens(config: Mapping[str, Any], family: str) -> VisionTokens:
    """The placeholder ids (transformers' defaults where a config names none)."""
    text = text_fields(config)

    def get(name: str, default: int) -> int:
        value = config.get(name, text.get(name))
        return int(default if value is None else value)

    per_second = (config.get("vision_config") or {}).get("tokens_per_second", 4) if family == "qwen2_5_vl" else None
    return VisionTokens(get("image_token_id", 151655), get("video_token_id", 151656), get("vision_start_token_id", 151652),
                        get("vision_end_token_id", 151653), None if per_second is None else float(per_second))


for _name, _architecture in (("qwen2_vl", "Qwen2VLForConditionalGeneration"), ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration")):
    register(Family(name=_name, model_types=(_name,), architectures=(_architecture,),
                    config=lambda c, name=_name: vl_config(c, name)))
