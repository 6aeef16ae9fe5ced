"""Qwen2 and Qwen2.5: the Llama decoder with a bias on q, k and v."""

from .config import decoder_config
from .registry import Family, register

FAMILY = register(
    Family(
        name="qwen2",
        model_types=("qwen2",),
        architectures=("Qwen2ForCausalLM",),
        config=lambda c: decoder_config(c, "qwen2", qkv_bias=True),
    )
)
