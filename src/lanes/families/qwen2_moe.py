"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Qwen2 attention (q/k/v bias) over routed experts, a
softmax over every expert and the top k kept, beside a shared expert that every token runs, scaled per
token by the sigmoid of its own gate."""

from __future__ import annotations

from typing import Any, Mapping

from .config import ModelConfig, MoEConfig, decoder_config, need
from .names import MoENames
from .registry import Family, register

NAMES = MoENames(router="mlp.gate", experts="mlp.experts.{e}.", shared="mlp.shared_expert.",
                 shared_gate="mlp.shared_expert_gate")


def qwen_dense_layers(c: Mapping[str, Any]) -> frozenset[int]:
    """Qwen2-MoE and Qwen3-MoE: a layer is routed unless `mlp_only_layers` names it or `decoder_sparse_step`
    passes it over (transformers' rule)."""
    step = int(c.get("decoder_sparse_step") or 1)
    only = set(c.get("mlp_only_layers") or ())
    return frozenset(i for i in range(int(need(c, "num_hidden_layers"))) if i in only or (i + 1) % step)


def softmax_moe(c: Mapping[str, Any], **more: Any) -> MoEConfig:
    """Qwen2-MoE's and Qwen3-MoE's routed experts; `more`: the shared expert's fields. The hub's configs
    say `num_experts`, transformers 5 writes `num_local_experts`."""
    experts = c.get("num_experts") if c.get("num_experts") is not None else need(c, "num_local_experts")
    return MoEConfig(experts=int(experts), top_k=int(need(c, "num_experts_per_tok")),
                     intermediate_size=int(need(c, "moe_intermediate_size")), normalize=bool(c.get("norm_topk_prob")),
                     dense_layers=qwen_dense_layers(c), **more)


def qwen2_moe_config(c: Mapping[str, Any]) -> ModelConfig:
    moe = softmax_moe(c, shared_size=int(need(c, "shared_expert_intermediate_size")), shared_gate=True)
    return decoder_config(c, "qwen2_moe", qkv_bias=bool(c.get("qkv_bias", True)), moe=moe)


FAMILY = register(Family(name="qwen2_moe", model_types=("qwen2_moe",), architectures=("Qwen2MoeForCausalLM",),
                         config=qwen2_moe_config, experts=NAMES))
