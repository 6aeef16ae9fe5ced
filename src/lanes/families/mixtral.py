"""Mixtral (8x7B, 8x22B): the Llama attention over eight routed experts, a softmax over the experts and
the top two renormalised (weights kept in float32, as the reference keeps them)."""

from __future__ import annotations

from typing import Any, Mapping

from .config import ModelConfig, MoEConfig, decoder_config, need
from .names import MoENames
from .registry import Family, register

NAMES = MoENames(router="block_sparse_moe.gate", experts="block_sparse_moe.experts.{e}.", gate="w1", up="w3", down="w2")


def mixtral_config(c: Mapping[str, Any]) -> ModelConfig:
    moe = MoEConfig(experts=int(need(c, "num_local_experts")), top_k=int(need(c, "num_experts_per_tok")),
                    intermediate_size=int(need(c, "intermediate_size")), normalize=True, fp32_weights=True)
    return decoder_config(c, "mixtral", moe=moe)


FAMILY = register(Family(name="mixtral", model_types=("mixtral",), architectures=("MixtralForCausalLM",),
                         config=mixtral_config, experts=NAMES))
