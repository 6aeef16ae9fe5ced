"""The fast decode step (Triton kernels; on CUDA also as CUDA graphs) against the eager forward.

Rules: tiny random models built in the test; runs on CUDA where there is a GPU, else under Triton's
interpreter on the CPU (TRITON_INTERPRET=1), else skips; fp32 logits within 1e-4 and identical greedy
tokens step after step, lanes at different lengths.
"""

import os

import pytest
import torch

import scenario
import tiny
from lanes.core.passes import Piece
from lanes.core.blocks import BlockTable
from lanes.gpu.device import choose, cuda_device_count

if cuda_device_count() == 0 and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is not on (TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")
DEVICE = "cuda" if cuda_device_count() else "cpu"

from lanes.loader import load_model  # noqa: E402


def decode_inputs(model, tables, lengths, tokens, width):
    dev = model.placement.device
    slots = [t.blocks[n // 16] * 16 + n % 16 for t, n in zip(tables, lengths)]
    table = [t.blocks + [model.decoder.kv.scratch_block] * (width - len(t.blocks)) for t in tables]
    return (torch.tensor(tokens, device=dev), torch.tensor(lengths, device=dev), torch.tensor(slots, device=dev),
            torch.tensor([n + 1 for n in lengths], device=dev), torch.tensor(table, device=dev))


@pytest.mark.parametrize("kind, overrides, lanes", [
    ("qwen2", {}, [5, 17, 33]), ("qwen3", dict(head_dim=32), [5, 17, 33]), ("llama", dict(num_key_value_heads=4), [5, 17, 33]),
    ("qwen2", {}, [21]), ("qwen3", dict(head_dim=32), [9]),  # one row: the fused GEMVs
    # MoE parts in the fast step: grouped sigmoid routing, a dense first layer, partial rotary in the RoPE kernel
    ("glm4_moe", dict(num_hidden_layers=3, attention_bias=True, n_group=2, topk_group=1), [5, 17, 33]),
    ("qwen2_moe", {}, [5, 17, 33]), ("qwen3_moe", dict(head_dim=32, num_experts=16, num_experts_per_tok=8), [9]),
])
def test_fast_decode_step_equals_the_eager_forward(kind, overrides, lanes, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    tiny.build(kind, tmp_path, **overrides)
    model = load_model(tmp_path, choose(DEVICE, "fp32"), kv_blocks=64, quiet=True)
    pool, tables, lengths, tokens = scenario.lanes_after_prefill(model, lanes)
    for _ in range(6):
        pieces = [Piece(i, (tok,), n, tuple(t.blocks)) for i, (tok, n, t) in enumerate(zip(tokens, lengths, tables))]
        eager = model.decoder.forward(pieces)
        fast = model.decoder.decode_step(*decode_inputs(model, tables, lengths, tokens, 8))
        torch.testing.assert_close(fast, eager, rtol=0, atol=1e-4)
        assert fast.argmax(-1).tolist() == eager.argmax(-1).tolist()
        tokens = eager.argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    for t in tables:
        t.clear(pool)
    pool.check_integrity()


@pytest.mark.parametrize("kind, dtype, captured", [
    ("qwen2", "fp32", True), ("qwen2", "bf16", True), ("qwen2", "fp32", False),
    ("qwen3_moe", "bf16", True),  # MoE layers captured: torch's fused grouped product, bf16 on Hopper
])
def test_graphed_decode_equals_the_eager_forward(kind, dtype, captured, tmp_path):
    """Captured (one rank) or launched uncaptured on the pieces' exact rows (what tensor-parallel ranks run)."""
    from lanes.families.linear import fused_on
    from lanes.gpu.graphs import greedy_draw
    from lanes.gpu.graphs import DecodeGraphs

    if captured and DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    if kind == "qwen3_moe" and not fused_on(torch.device(DEVICE), torch.bfloat16):
        pytest.skip("no fused grouped product on this GPU: MoE layers stay uncaptured")
    torch.backends.cuda.matmul.allow_tf32 = False
    tiny.build(kind, tmp_path, **(dict(head_dim=32, num_experts=16, num_experts_per_tok=4) if kind == "qwen3_moe" else {}))
    model = load_model(tmp_path, choose(DEVICE, dtype), kv_blocks=64, quiet=True)
    graphs = DecodeGraphs(model.decoder, max_lanes=8, max_model_len=128)
    if captured:
        assert model.decoder.graph_safe
        graphs.capture(quiet=True)
        assert graphs.feeds  # captured: replays read the last draws
    pool, tables, lengths, tokens = scenario.lanes_after_prefill(model, [5, 17, 33])
    agree = 0
    for step in range(8):
        pieces = [Piece(i, (tok,), n, tuple(t.blocks)) for i, (tok, n, t) in enumerate(zip(tokens, lengths, tables))]
        eager = model.decoder.forward(pieces).float()
        replayed, drawn = graphs.run(pieces)
        if captured:  # the draw inside the graph is the one the sampler would make from these logits
            assert torch.equal(drawn.clone(), greedy_draw(replayed))
        replayed = replayed.float().clone()
        if dtype == "fp32":
            torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-4)
        else:
            error = ((replayed - eager).norm() / eager.norm()).item()
            assert error < 2e-2, error
        agree += replayed.argmax(-1).tolist() == eager.argmax(-1).tolist()
        tokens = eager.argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    assert agree == 8 if dtype == "fp32" else agree >= 6
    scratch = model.decoder.kv.scratch_block
    assert all(scratch not in t.blocks for t in tables)
    for t in tables:
        t.clear(pool)
    pool.check_integrity()


@pytest.mark.parametrize("dtype, captured", [("fp32", True), ("bf16", True), ("fp32", False)])
def test_passes_with_short_prompts_equal_the_general_forward(dtype, captured, tmp_path):
    """Prompts (a whole one, a first chunk without logits, its next chunk) beside decode rows, in one
    graph: the asked-for rows' logits equal the general forward's, and decoding on goes on agreeing."""
    from lanes.gpu.graphs import greedy_draw
    from lanes.gpu.graphs import DecodeGraphs

    if captured and DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    tiny.build("qwen2", tmp_path)
    model = load_model(tmp_path, choose(DEVICE, dtype), kv_blocks=64, quiet=True)
    graphs = DecodeGraphs(model.decoder, max_lanes=8, max_model_len=128, prompt_rows=40)
    assert graphs.buckets[-1] == 40
    if captured:
        graphs.capture(quiet=True)
    pool, tables, lengths, tokens = scenario.lanes_after_prefill(model, [5, 17])
    for lane in (2, 3):
        tables.append(BlockTable(("lane", lane)))
        tables[-1].reserve(pool, 40)
    g = torch.Generator().manual_seed(9)
    fresh, long = (torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 20))

    def compare(pieces):
        eager = model.decoder.forward(pieces).float()
        fast, drawn = graphs.run(pieces)
        assert fast.shape == eager.shape
        if captured:
            assert torch.equal(drawn.clone(), greedy_draw(fast))
        fast = fast.float().clone()
        if dtype == "fp32":
            torch.testing.assert_close(fast, eager, rtol=0, atol=1e-4)
        else:
            assert ((fast - eager).norm() / eager.norm()).item() < 2e-2
        return eager.argmax(-1).tolist(), fast.argmax(-1).tolist()

    decode = [Piece(i, (tok,), n, tuple(t.blocks)) for i, (tok, n, t) in enumerate(zip(tokens, lengths, tables))]
    first = [Piece(2, tuple(fresh), 0, tuple(tables[2].blocks)), Piece(3, tuple(long[:12]), 0, tuple(tables[3].blocks), "none")]
    assert graphs.fits(first + decode)
    eager, fast = compare(first + decode)
    agree = eager == fast
    tokens, lengths = eager[1:] + [eager[0]], [n + 1 for n in lengths] + [len(fresh)]
    second = [Piece(3, tuple(long[12:]), 12, tuple(tables[3].blocks))]
    for step in range(4):
        pieces = [Piece(i, (tok,), n, tuple(tables[i].blocks)) for i, tok, n in zip((0, 1, 2), tokens, lengths)]
        eager, fast = compare((second if step == 0 else []) + pieces)
        agree += eager == fast
        tokens, lengths = eager[-3:], [n + 1 for n in lengths]
    assert agree == 5 if dtype == "fp32" else agree >= 3
    assert not graphs.fits([Piece(0, tuple(long), 0, tuple(tables[3].blocks), "all")])  # prompt logprobs: general
    assert not graphs.fits([Piece(0, (1,) * 41, 0, tuple(tables[3].blocks) * 2)])  # more rows than the largest bucket
    for t in tables:
        t.clear(pool)
    pool.check_integrity()
