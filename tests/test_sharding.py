"""Tensor-parallel shards in one process: a model built for world 2 (and 4), every rank run as a thread whose
collectives sum or gather the others' partial outputs, equals the same model at world 1 (dense families,
and MoE families whose every rank holds a slice of every expert).

Rules: tiny random models built in the test; fp32 on the CPU; logits within 1e-5 of world 1; identical
greedy tokens on every rank; each rank's block pool balanced.
"""

import threading

import pytest
import torch

import scenario
import tiny
from lanes.families.weights import Shard
from lanes.core.blocks import BlockPool
from lanes.gpu.collective import ThreadGroup
from lanes.gpu.device import choose
from lanes.loader import load_model


def run_ranks(folder, world: int, prompt_ids):
    group = ThreadGroup(world, timeout=120)
    results: list = [None] * world
    errors: list = []

    def rank_main(rank: int) -> None:
        try:
            model = load_model(folder, choose("cpu", "fp32"), shard=Shard(rank, world), comm=group.member(rank),
                               kv_blocks=64, quiet=True)
            pool = BlockPool(model.kv_blocks)
            results[rank] = scenario.run(model.decoder, pool, prompt_ids, steps=8)
            pool.check_integrity()
            assert pool.free == pool.total
        except BaseException as error:  # reported on the test's thread
            errors.append(error)
            group._barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize(
    "kind, world, overrides",
    [
        ("qwen2", 2, dict(num_key_value_heads=2)),  # KV heads split, q/k/v bias split
        ("llama", 2, dict(num_key_value_heads=1, tie_word_embeddings=True)),  # one KV head replicated
        ("qwen3", 4, dict(num_key_value_heads=2, head_dim=16)),  # q/k norms per head, KV heads replicated pairwise
        ("llama", 2, dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),  # row-parallel biases added once
        ("qwen2_moe", 2, dict(num_key_value_heads=2)),  # every expert's intermediate split, the gated shared expert too
        ("glm4_moe", 2, dict(num_hidden_layers=3, n_group=2, topk_group=1)),  # a dense first layer, sigmoid routing
        ("mixtral", 2, dict(num_key_value_heads=1)),  # routed partial sums, the one KV head replicated
        ("qwen3_moe", 4, dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)),  # four slices of each expert
    ],
)
def test_world_n_equals_world_1(kind, world, overrides, tmp_path):
    tiny.build(kind, tmp_path, vocab_size=271, **overrides)
    solo_model = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    assert solo_model.config.vocab_size % world != 0  # the vocabulary is padded per rank
    prompt_ids = scenario.prompts(solo_model.config.vocab_size)
    solo = scenario.run(solo_model.decoder, BlockPool(64), prompt_ids, steps=8)
    for sharded in run_ranks(tmp_path, world, prompt_ids):
        for mine, ref in zip(sharded[0] + sharded[1], solo[0] + solo[1]):
            torch.testing.assert_close(mine, ref, rtol=0, atol=1e-5)
        assert sharded[2] == solo[2]


def test_a_split_that_does_not_divide_is_refused(tmp_path):
    from lanes.checkpoint.errors import CheckpointError

    tiny.build("llama", tmp_path, num_key_value_heads=2, num_attention_heads=4)
    with pytest.raises(CheckpointError, match="attention heads \\(4\\) do not split over 3 ranks"):
        load_model(tmp_path, choose("cpu", "fp32"), shard=Shard(0, 3), kv_blocks=4, quiet=True)
