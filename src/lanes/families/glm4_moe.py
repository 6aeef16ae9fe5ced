"""GLM-4.5 and GLM-4.6 (and -Air): attention with a q/k/v bias and RoPE over half of each head, leading
dense layers, then MoE blocks: sigmoid scores chosen with a correction bias from the best groups, the
chosen scores renormalised and scaled, beside shared experts every token runs. The checkpoints' extra
multi-token-prediction layer is not read."""

from __future__ import annotations

from typing import Any, Mapping

from .config import ConfigFault, ModelConfig, MoEConfig, decoder_config, need
from .names import MoENames
from .registry import Family, register

NAMES = MoENames(router="mlp.gate", experts="mlp.experts.{e}.", shared="mlp.shared_experts.",
                 correction="mlp.gate.e_score_correction_bias")


def glm4_moe_config(c: Mapping[str, Any]) -> ModelConfig:
    experts, groups = int(need(c, "n_routed_experts")), int(c.get("n_group") or 1)
    top_k, top_groups = int(need(c, "num_experts_per_tok")), int(c.get("topk_group") or 1)
    if experts % groups or experts // groups < 2 or top_groups * (experts // groups) < top_k:
        raise ConfigFault(f"{experts} experts in {groups} groups cannot give {top_k} from {top_groups} groups")
    inter = int(need(c, "moe_intermediate_size"))
    moe = MoEConfig(experts=experts, top_k=top_k, intermediate_size=inter, routing="sigmoid",
                    normalize=bool(c.get("norm_topk_prob", True)), scale=float(c.get("routed_scaling_factor") or 1.0),
                    groups=groups, top_groups=top_groups, correction_bias=True,
                    shared_size=inter * int(c.get("n_shared_experts") or 0), fp32_weights=True,
                    dense_layers=frozenset(range(int(c.get("first_k_dense_replace") or 0))))
    rope = c.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))  # transformers' default for GLM
    return decoder_config(c, "glm4_moe", qkv_bias=bool(c.get("attention_bias")), qk_norm=bool(c.get("use_qk_norm")),
                          partial_rotary=float(partial), moe=moe)


FAMILY = register(Family(name="glm4_moe", model_types=("glm4_moe",), architectures=("Glm4MoeForCausalLM",),
                         config=glm4_moe_config, experts=NAMES))
