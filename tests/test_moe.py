"""The MoE parts alone: routers against transformers' own router modules, and the grouped experts against
transformers' experts module, on random inputs.

Rules: transformers' modules built from small configs in the test, their weights random; fp32 on the CPU;
expert ids equal as sets per token, routing weights and outputs within 1e-6; the grouped product checked
on both of its paths (torch's grouped product, and the loop over experts that devices without it take),
with experts that get no rows.
"""

import pytest
import torch
import transformers
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

import lanes.families.linear as linear
from lanes.quant import weight
from lanes.families.config import MoEConfig
from lanes.families.linear import ExpertLinear, Groups, Linear
from lanes.families.moe import Experts
from lanes.families.routing import SigmoidGroupRouter, SoftmaxRouter

HIDDEN = 64


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    """Each token's {expert: weight}, whatever order topk gave them in."""
    return [dict(zip(i.tolist(), w.tolist())) for i, w in zip(ids, weights)]


def assert_same_routing(ours, theirs) -> None:
    """`ours`, `theirs`: (weights [T, k], ids [T, k])."""
    mine, ref = by_expert(*ours), by_expert(*theirs)
    assert [m.keys() for m in mine] == [r.keys() for r in ref]
    for m, r in zip(mine, ref):
        assert [m[e] for e in r] == pytest.approx([r[e] for e in r], abs=1e-6)


@pytest.mark.parametrize("experts, top_k, normalize", [(8, 1, False), (8, 2, True), (64, 8, True), (16, 4, False)])
def test_softmax_router_equals_qwen3_moe_router(experts, top_k, normalize, monkeypatch):
    # within 1e-6 of transformers: the router's product routed as transformers' (F.linear), not ours, whose
    # summation order moves a weight by up to 2e-6; the weights drawn from the test's own seed
    monkeypatch.setattr(weight, "few_rows", lambda: weight.FEW_ROWS)
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=normalize)
    reference = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(experts, HIDDEN, generator=torch.Generator().manual_seed(10 * experts + top_k)) * 0.5)
    ours = SoftmaxRouter(Linear(reference.weight.detach()), MoEConfig(experts, top_k, 32, normalize=normalize))
    h = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(experts + top_k))
    with torch.no_grad():
        _, weights, ids = reference(h)
    assert_same_routing(ours(h), (weights, ids))


def test_softmax_router_equals_mixtral_router_and_keeps_float32_weights(monkeypatch):
    monkeypatch.setattr(weight, "few_rows", lambda: weight.FEW_ROWS)  # as the test above
    config = transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    reference = MixtralTopKRouter(config)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.5)
    ours = SoftmaxRouter(Linear(reference.weight.detach()), MoEConfig(8, 2, 32, normalize=True, fp32_weights=True))
    h = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, weights, ids = reference(h)
    routed = ours(h)
    assert routed[0].dtype == torch.float32
    assert_same_routing(routed, (weights, ids))


@pytest.mark.parametrize("experts, top_k, groups, top_groups, normalize, scale", [
    (8, 2, 1, 1, True, 1.0), (16, 4, 4, 2, True, 2.5), (32, 8, 8, 3, False, 1.0), (16, 6, 2, 1, True, 1.8),
])
def test_sigmoid_group_router_equals_glm4_moe_router(experts, top_k, groups, top_groups, normalize, scale):
    config = transformers.Glm4MoeConfig(hidden_size=HIDDEN, n_routed_experts=experts, num_experts_per_tok=top_k,
                                        n_group=groups, topk_group=top_groups, norm_topk_prob=normalize,
                                        routed_scaling_factor=scale)
    reference = Glm4MoeTopkRouter(config)
    generator = torch.Generator().manual_seed(experts * top_k + groups)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(experts, HIDDEN, generator=generator) * 0.5)
        reference.e_score_correction_bias.copy_(torch.randn(experts, generator=generator) * 0.1)
    moe = MoEConfig(experts, top_k, 32, routing="sigmoid", normalize=normalize, scale=scale, groups=groups,
                    top_groups=top_groups, correction_bias=True, fp32_weights=True)
    ours = SigmoidGroupRouter(Linear(reference.weight.detach()), reference.e_score_correction_bias, moe)
    h = torch.randn(29, HIDDEN, generator=generator)
    with torch.no_grad():
        _, weights, ids = reference(h)
    assert_same_routing(ours(h), (weights, ids))


@pytest.mark.parametrize("grouped_mm", [True, False])
@pytest.mark.parametrize("tokens, experts, top_k", [(3, 16, 2), (40, 8, 2), (5, 64, 8)])  # more experts than picks, and fewer
def test_grouped_experts_equal_transformers_experts(grouped_mm, tokens, experts, top_k, monkeypatch):
    if not grouped_mm:
        monkeypatch.setattr(linear, "_GROUPED_MM", None)
    elif linear._GROUPED_MM is None:
        pytest.skip("this torch has no grouped product")
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=experts, num_experts_per_tok=top_k,
                                         moe_intermediate_size=32, experts_implementation="eager")  # its Python loop
    reference = Qwen3MoeExperts(config)
    generator = torch.Generator().manual_seed(tokens + experts)
    with torch.no_grad():
        reference.gate_up_proj.copy_(torch.randn(experts, 64, HIDDEN, generator=generator) * 0.2)
        reference.down_proj.copy_(torch.randn(experts, HIDDEN, 32, generator=generator) * 0.2)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    ours = Experts(ExpertLinear(reference.gate_up_proj.detach()), ExpertLinear(reference.down_proj.detach()))
    with torch.no_grad():
        # 2e-6: on the CPU the activation is our silu (within 1.8 ulp of float64; torch's, the reference's, 1.5)
        torch.testing.assert_close(ours(x, weights, ids), reference(x, ids, weights), rtol=0, atol=2e-6)


def test_groups_read_their_counts_on_the_host_once():
    groups = Groups(torch.tensor([0, 3, 3, 7], dtype=torch.int32))
    assert groups.counts() == [0, 3, 0, 4]
    assert groups.counts() is groups.counts()


@pytest.mark.parametrize("picks, experts", [([0, 0, 2, 2, 2, 5, 7], 9), ([3], 4), ([], 4), ([1, 1, 1], 2)])
def test_groups_of_sorted_picks_end_where_a_count_says(picks, experts):
    sorted_picks = torch.tensor(picks, dtype=torch.int64)
    groups = Groups.of_sorted(sorted_picks, experts)
    expected = torch.bincount(sorted_picks, minlength=experts).cumsum(0).to(torch.int32)
    assert groups.ends.dtype == torch.int32 and torch.equal(groups.ends, expected)
