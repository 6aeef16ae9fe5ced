"""Each family against transformers' forward: ragged prompts prefilled together, one in chunks, then 16
decode steps through the block pool with lanes at different lengths.

Rules: tiny random models built in the test with transformers (`from_config`, every weight random,
`save_pretrained` to a temp folder); fp32 on the CPU; logits within 1e-4 (max abs); greedy tokens
identical; the block pool balanced after each test. The MoE configs cover top-k of 1, 2 and 8, shared
experts (gated and not), dense layers among routed ones, grouped sigmoid routing with a correction bias,
partial rotary, and more experts than a decode pass has tokens (4 rows a pass, up to 64 experts).
"""

import pytest
import torch

import scenario
import tiny
from lanes.core.blocks import BlockPool
from lanes.families.moe import MoE
from lanes.gpu.device import choose
from lanes.loader import load_model

CASES = {
    "llama-gqa-llama3-rope": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                             rope_theta=500000.0)),
    "llama-mha-bias": ("llama", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    "qwen2-qkv-bias": ("qwen2", dict(num_key_value_heads=1)),
    "qwen3-tied-qk-norm": ("qwen3", dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3-yarn": ("qwen3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen3_moe-top8-of-64-dense-middle": ("qwen3_moe", dict(num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
                                                             num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen3_moe-top1-sparse-step": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=1, decoder_sparse_step=2,
                                                      num_hidden_layers=3)),
    "qwen2_moe-gated-shared-expert": ("qwen2_moe", dict(num_key_value_heads=1)),
    "mixtral-top2": ("mixtral", dict(head_dim=24)),
    "glm4_moe-dense-first-grouped": ("glm4_moe", dict(num_hidden_layers=3, n_group=2, topk_group=1, attention_bias=True,
                                                       routed_scaling_factor=2.5)),
    "glm4_moe-qk-norm-two-shared-top8": ("glm4_moe", dict(n_routed_experts=16, num_experts_per_tok=8, n_group=4, topk_group=2,
                                                           use_qk_norm=True, n_shared_experts=2, norm_topk_prob=False,
                                                           rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                                                            "partial_rotary_factor": 0.25})),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_equals_transformers(case, tmp_path):
    kind, overrides = CASES[case]
    reference_model = tiny.build(kind, tmp_path, **overrides)
    model = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    assert model.config.family == kind
    routed = [hasattr(layer.mlp, "experts") for layer in reference_model.model.layers]
    assert [isinstance(layer.ffn, MoE) for layer in model.decoder.weights.layers] == routed
    pool = BlockPool(model.kv_blocks)
    prompt_ids = scenario.prompts(model.config.vocab_size)
    ours = scenario.run(model.decoder, pool, prompt_ids)
    theirs = scenario.reference(reference_model, prompt_ids, ours[2], steps=16)
    for mine, ref in zip(ours[0], theirs[0]):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-4)
    for mine, ref in zip(ours[1], theirs[1]):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-4)
    scenario.assert_same_greedy(prompt_ids, ours, theirs)
    pool.check_integrity()
    assert pool.free == pool.total


@pytest.mark.parametrize("kind", ["default", "linear", "llama3", "yarn"])
def test_rope_frequencies_equal_transformers(kind):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from lanes.families.llama import FAMILY
    from lanes.families.rope import inverse_frequencies

    params = {"default": {}, "linear": {"factor": 3.0},
              "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
              "yarn": {"factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16}}[kind]
    hf = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=512,
                     rope_scaling={"rope_type": kind, **params} if params else None, rope_theta=10000.0)
    ours, scale = inverse_frequencies(FAMILY.config(hf.to_dict()))
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        theirs, their_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    assert scale == pytest.approx(their_scale, abs=1e-12)
