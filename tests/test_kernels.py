"""The decode path's Triton kernels against the eager path on random inputs of many shapes.

Rules: runs on CUDA where there is a GPU, else on the CPU under Triton's interpreter (TRITON_INTERPRET=1
set before Triton is imported), else skips. fp32 within 1e-5 (relative error); bf16 within METHOD's bf16
band (relative error under 1e-2) and never NaN; fresh random inputs for every shape.
"""

import os

import pytest
import torch

from lanes.gpu.device import cuda_device_count

if cuda_device_count() == 0:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton's interpreter is not on (TRITON_INTERPRET=1)", allow_module_level=True)
DEVICE = "cuda" if cuda_device_count() else "cpu"
pytest.importorskip("triton")

from lanes.families.norm import rms_norm  # noqa: E402
from lanes.families.rope import cos_sin  # noqa: E402
from lanes.gpu import kernels, paged_kernel  # noqa: E402
from lanes.gpu.attention import PagedRows, RowSpan, paged_attention  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def close(mine: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert not torch.isnan(mine).any()
    error = ((mine.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lanes, hq, hkv, d, lengths", [
    (1, 14, 2, 64, [1]), (3, 4, 4, 32, [5, 16, 17]), (5, 8, 1, 64, [70, 3, 129, 64, 1]), (2, 6, 2, 80, [33, 200]),
    (1, 14, 2, 64, [1000]),
])
@pytest.mark.parametrize("splits, fused", [(None, True), (1, True), (3, True), (3, False)])
def test_paged_decode_attention_equals_the_gather_reference(dtype, lanes, hq, hkv, d, lengths, splits, fused):
    g = torch.Generator().manual_seed(lanes * 100 + d)
    blocks = 64
    cache_k = torch.randn(blocks * 16, hkv, d, generator=g).to(DEVICE, dtype)
    cache_v = torch.randn(blocks * 16, hkv, d, generator=g).to(DEVICE, dtype)
    perm = torch.randperm(blocks, generator=g).tolist()  # tables point anywhere in the pool
    tables, spans, at = [], [], 0
    for n in lengths:
        need = -(-n // 16)
        tables.append(perm[at : at + need])
        spans.append(RowSpan(n - 1, 1, perm[at : at + need]))
        at += need
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(lanes, hq, d, generator=g).to(DEVICE, dtype)
    mine = kernels.paged_decode_attention(q, cache_k, cache_v, table, lens, d**-0.5, 16, tile=16, splits=splits, fused=fused)
    if fused:  # the counters are left zeroed for the next call (a graph's next replay)
        assert not any(t.any() for t in paged_kernel._arrivals.values())
    rows = PagedRows(spans, 16, torch.device(DEVICE))
    ref = paged_attention(q.float(), cache_k.float(), cache_v.float(), rows, d**-0.5)
    close(mine, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prompts", [[(0, 5)], [(3, 17), (0, 1), (30, 40)]])
def test_prompt_rows_sharing_a_table_row_attend_causally(dtype, prompts):
    """Each (start, count) prompt is `count` query rows of one lane reading one table row, row i seeing
    positions up to start + i: the causal attention of the general forward's prompt rows."""
    g = torch.Generator().manual_seed(len(prompts))
    hq, hkv, d, blocks = 8, 2, 32, 32
    cache_k = torch.randn(blocks * 16, hkv, d, generator=g).to(DEVICE, dtype)
    cache_v = torch.randn(blocks * 16, hkv, d, generator=g).to(DEVICE, dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, spans, lens, table_rows, at = [], [], [], [], 0
    for lane, (start, count) in enumerate(prompts):
        need = -(-(start + count) // 16)
        tables.append(perm[at : at + need])
        spans.append(RowSpan(start, count, perm[at : at + need]))
        lens += range(start + 1, start + count + 1)
        table_rows += [lane] * count
        at += need
    width = max(len(t) for t in tables) + 1  # a spare column: a row never reads past its own length
    table = torch.tensor([t + [perm[-1]] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), hq, d, generator=g).to(DEVICE, dtype)
    mine = kernels.paged_decode_attention(q, cache_k, cache_v, table, torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                          d**-0.5, 16, tile=16, table_rows=torch.tensor(table_rows, device=DEVICE))
    ref = paged_attention(q.float(), cache_k.float(), cache_v.float(), PagedRows(spans, 16, torch.device(DEVICE)), d**-0.5)
    close(mine, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_of_picked_rows_is_those_rows_of_the_whole(dtype):
    g = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(9, 64, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(64, generator=g)).to(DEVICE, dtype)
    rows = torch.tensor([8, 0, 3, 3], device=DEVICE)
    whole, whole_res = kernels.add_rms_norm(x, residual, weight, 1e-6)
    picked, picked_res = kernels.add_rms_norm(x, residual, weight, 1e-6, rows=rows)
    assert torch.equal(picked, whole[rows]) and torch.equal(picked_res, whole_res[rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols, with_residual", [(1, 896, True), (7, 64, False), (64, 576, True), (3, 100, True)])
def test_add_rms_norm_equals_eager(dtype, rows, cols, with_residual):
    g = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, cols, generator=g).to(DEVICE, dtype)
    residual = torch.randn(rows, cols, generator=g).to(DEVICE, dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(cols, generator=g)).to(DEVICE, dtype)
    out, res = kernels.add_rms_norm(x, residual, weight, 1e-6)
    expected_res = x + residual if with_residual else x
    if dtype == torch.float32:
        assert torch.equal(res, expected_res)
    close(res, expected_res, dtype)  # the interpreter rounds bf16 by truncation, a GPU to nearest
    close(out, rms_norm(expected_res, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hq, hkv, d, rotary", [
    (1, 14, 2, 64, 64), (9, 4, 4, 32, 32), (33, 8, 2, 128, 128),
    (5, 12, 2, 128, 64), (3, 4, 2, 16, 8), (7, 4, 1, 64, 16),  # partial rotary (GLM-4.5 rotates half of each head)
])
def test_rope_write_kv_equals_eager_rotation_and_write(dtype, tokens, hq, hkv, d, rotary):
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(tokens * d + rotary)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    positions = torch.randint(0, 3000, (tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(256, generator=g)[:tokens].to(DEVICE)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))).to(DEVICE)
    cache_k = torch.zeros(256, hkv, d, device=DEVICE, dtype=dtype)
    cache_v = torch.zeros(256, hkv, d, device=DEVICE, dtype=dtype)
    q = kernels.rope_write_kv(qkv, positions, slots, inv_freq, 1.0, cache_k, cache_v, hq, hkv, d, rotary_dim=rotary)
    qe, ke, ve = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    cos, sin = cos_sin(inv_freq, 1.0, positions, dtype)  # [T, rotary]
    # transformers' rotation (the first `rotary` dimensions of each head; the rest pass through), [1, H, T, D]
    heads = lambda x, h: x.view(tokens, h, d).transpose(0, 1)[None]  # noqa: E731
    q_ref, k_ref = apply_rotary_pos_emb(heads(qe, hq), heads(ke, hkv), cos[None], sin[None])
    close(q, q_ref[0].transpose(0, 1), dtype)
    close(cache_k[slots], k_ref[0].transpose(0, 1), dtype)
    assert torch.equal(cache_v[slots], ve.reshape(tokens, hkv, d))
    if rotary < d:  # the dimensions past the rotated ones are copied exactly
        assert torch.equal(q[..., rotary:], qe.view(tokens, hq, d)[..., rotary:])
        assert torch.equal(cache_k[slots][..., rotary:], ke.view(tokens, hkv, d)[..., rotary:])
    untouched = torch.ones(256, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not cache_k[untouched].any() and not cache_v[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 4864), (5, 96), (64, 1536)])
def test_silu_mul_equals_eager(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, dtype)


def test_fed_embedding_takes_fed_rows_from_the_draws():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(50, 24, generator=g).to(DEVICE, torch.bfloat16)
    tokens = torch.tensor([3, 0, 49, 7], device=DEVICE)
    feed = torch.tensor([-1, 2, -1, 0], device=DEVICE)
    drawn = torch.tensor([11, 12, 13], device=DEVICE)
    mine = kernels.fed_embedding(tokens, feed, drawn, weight)
    assert torch.equal(mine, weight[torch.tensor([3, 13, 49, 11], device=DEVICE)])
