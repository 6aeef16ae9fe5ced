"""The MoE experts on CUDA: torch's fused grouped product (bf16 on Hopper) against the loop over experts and
against transformers' experts in fp32, and the block captured in a CUDA graph equal to it run eagerly.

Rules: CUDA only (skipped without a GPU, or where the grouped product is not one kernel); random inputs
from fixed seeds; bf16 results within 1e-2 relative error (METHOD's bf16 band) of the fp32 reference.
"""

import pytest
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import lanes.families.linear as linear
from lanes.families.linear import ExpertLinear, fused_on
from lanes.families.moe import Experts
from lanes.gpu.device import cuda_device_count

if cuda_device_count() == 0:
    pytest.skip("no GPU", allow_module_level=True)
if not fused_on(torch.device("cuda", 0), torch.bfloat16):
    pytest.skip("torch's grouped product is not one kernel on this GPU", allow_module_level=True)

HIDDEN, INTER = 256, 128


def relative(mine: torch.Tensor, ref: torch.Tensor) -> float:
    return ((mine.double() - ref.double()).norm() / ref.double().norm()).item()


def problem(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) * 0.05
    down = torch.randn(experts, HIDDEN, INTER, generator=g) * 0.05
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return gate_up, down, x, ids, weights


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 128, 8), (16, 128, 8), (64, 16, 2), (300, 8, 2)])
def test_fused_experts_equal_the_loop_and_transformers(tokens, experts, top_k, monkeypatch):
    gate_up, down, x, ids, weights = problem(tokens, experts, top_k, tokens + experts)
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=experts, num_experts_per_tok=top_k,
                                         moe_intermediate_size=INTER, experts_implementation="eager")
    reference = Qwen3MoeExperts(config)
    with torch.no_grad():
        reference.gate_up_proj.copy_(gate_up)
        reference.down_proj.copy_(down)
        expected = reference(x, ids, weights)
    ours = Experts(ExpertLinear(gate_up.cuda().bfloat16()), ExpertLinear(down.cuda().bfloat16()))
    xb, wb, ib = x.cuda().bfloat16(), weights.cuda(), ids.cuda()
    assert ours.gate_up.fused(xb)
    fused = ours(xb, wb, ib)
    monkeypatch.setattr(linear, "_GROUPED_MM", None)
    looped = ours(xb, wb, ib)
    assert relative(fused.cpu(), expected) < 1e-2 and relative(looped.cpu(), expected) < 1e-2
    assert relative(fused, looped) < 1e-2


def test_fused_experts_in_a_cuda_graph_equal_them_run_eagerly():
    gate_up, down, x, ids, weights = problem(64, 128, 8, 7)
    ours = Experts(ExpertLinear(gate_up.cuda().bfloat16()), ExpertLinear(down.cuda().bfloat16()))
    static = [x.cuda().bfloat16(), weights.cuda(), ids.cuda()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ours(*static)  # the kernels' first launches, outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = ours(*static)
    _, _, x2, ids2, weights2 = problem(64, 128, 8, 8)  # new routing: other experts, other row counts
    for held, new in zip(static, (x2.cuda().bfloat16(), weights2.cuda(), ids2.cuda())):
        held.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ours(*static))
