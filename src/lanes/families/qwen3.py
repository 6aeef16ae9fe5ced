"""Qwen3: the Llama decoder with an RMSNorm on each head of q and k before RoPE."""

from .config import decoder_config
from .registry import Family, register

FAMILY = register(
    Family(
        name="qwen3",
        model_types=("qwen3",),
        architectures=("Qwen3ForCausalLM",),
        config=lambda c: decoder_config(
            c,
            "qwen3",
            qk_norm=True,
            qkv_bias=bool(c.get("attention_bias")),
            o_bias=bool(c.get("attention_bias")),
        ),
    )
)
