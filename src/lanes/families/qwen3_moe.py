"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 attention (q/k norms) over routed experts, a
softmax over every expert and the top k kept (renormalised where `norm_topk_prob` says so); no shared expert."""

from __future__ import annotations

from typing import Any, Mapping

from .config import ModelConfig, decoder_config
from .names import MoENames
from .qwen2_moe import softmax_moe
from .registry import Family, register

NAMES = MoENames(router="mlp.gate", experts="mlp.experts.{e}.")


def qwen3_moe_config(c: Mapping[str, Any]) -> ModelConfig:
    bias = bool(c.get("attention_bias"))
    return decoder_config(c, "qwen3_moe", qk_norm=True, qkv_bias=bias, o_bias=bias, moe=softmax_moe(c))


FAMILY = register(Family(name="qwen3_moe", model_types=("qwen3_moe",), architectures=("Qwen3MoeForCausalLM",),
                         config=qwen3_moe_config, experts=NAMES))
