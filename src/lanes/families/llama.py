"""Llama 2 and 3, SmolLM, TinyLlama, stories: the plain decoder, biases only where the config asks."""

from .config import decoder_config
from .registry import Family, register

FAMILY = register(
    Family(
        name="llama",
        model_types=("llama",),
        architectures=("LlamaForCausalLM",),
        config=lambda c: decoder_config(
            c,
            "llama",
            qkv_bias=bool(c.get("attention_bias")),
            o_bias=bool(c.get("attention_bias")),
            mlp_bias=bool(c.get("mlp_bias")),
        ),
    )
)
