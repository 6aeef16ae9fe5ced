"""The CPU path's own kernels besides the products: paged attention (lanes/quant/cpu_attention.cpp) against
torch's SDPA in float64, the MLP's silu (cpu_activation.cpp) against torch's, RMSNorm (cpu_norm.cpp) against
the decoders' formula in float64, RoPE's cos and sin, and its rotation (cpu_rope.cpp) against the Hugging
Face formula bit for bit, log-softmax and the greedy draw (cpu_softmax.cpp) against torch's; and
their batch invariance: a row's output is the same, bit for bit, whichever rows share its pass (alone, as
one of a drafted lane's 1 + k rows, beside other lanes long or short, beside a prompt being prefilled).

Rules: random caches, queries and activations made here; scattered block tables; the references are torch's
scaled_dot_product_attention over each lane's own gathered context in float64, and torch's silu in float64;
skipped only where the kernels cannot be built.
"""

import pytest
import torch
import torch.nn.functional as F

from lanes.families.activation import silu_mul
from lanes.families.norm import rms_norm
from lanes.families.rope import apply_rotary, cos_sin
from lanes.gpu.attention import PagedRows, RowSpan, paged_attention
from lanes.quant.native import available

BS = 16
pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernels cannot be built here (neither AVX-512 nor AVX2)")


def caches(slots: int, kv_heads: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, kv_heads, d, generator=g), torch.randn(slots, kv_heads, d, generator=g)


def tables(count: int, blocks: int, seed: int = 1) -> list[list[int]]:
    """`count` disjoint block tables of `blocks` blocks each, scattered over the pool."""
    order = torch.randperm(count * blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i * blocks : (i + 1) * blocks] for i in range(count)]


def reference(q, ck, cv, spans, scale):
    """Each lane's rows over its own context, causal, in float64."""
    out, row = [], 0
    for span in spans:
        end = span.start + span.length
        pos = torch.arange(end)
        slots = torch.tensor(span.blocks)[pos // BS] * BS + pos % BS
        k, v = ck[slots].double().transpose(0, 1), cv[slots].double().transpose(0, 1)  # [Hkv, L, D]
        rows = q[row : row + span.length].double().transpose(0, 1)  # [Hq, n, D]
        mask = torch.arange(end)[None, :] <= (span.start + torch.arange(span.length))[:, None]
        groups = q.shape[1] // ck.shape[1]
        att = F.scaled_dot_product_attention(rows, k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0),
                                             attn_mask=mask, scale=scale)
        out.append(att.transpose(0, 1))
        row += span.length
    return torch.cat(out)


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 3, 80), (2, 1, 16)])
def test_rows_equal_sdpa_in_float64(heads, kv_heads, d):
    ck, cv = caches(64 * BS, kv_heads, d)
    blocks = tables(4, 16)
    spans = [RowSpan(0, 37, blocks[0]), RowSpan(99, 1, blocks[1]), RowSpan(250, 6, blocks[2]), RowSpan(15, 2, blocks[3])]
    q = torch.randn(46, heads, d, generator=torch.Generator().manual_seed(2))
    got = paged_attention(q, ck, cv, PagedRows(spans, BS, torch.device("cpu")), d**-0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, ck, cv, spans, d**-0.5), rtol=0, atol=2e-6)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 300])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(length):
    heads, kv_heads, d = 9, 3, 64
    ck, cv = caches(64 * BS, kv_heads, d)
    mine, long, prompt = tables(3, 20)
    q = torch.randn(80, heads, d, generator=torch.Generator().manual_seed(3))
    drafted = q[:9]  # the lane's last 9 rows; its own row is the last
    at = length - 1

    def row_of(spans, queries, index):
        return paged_attention(queries, ck, cv, PagedRows(spans, BS, torch.device("cpu")), d**-0.5)[index]

    alone = row_of([RowSpan(at, 1, mine)], drafted[8:], 0)
    verify = min(9, length)  # as the last of a drafted lane's rows
    assert torch.equal(row_of([RowSpan(length - verify, verify, mine)], drafted[9 - verify :], verify - 1), alone)
    beside = torch.cat([q[20:21], drafted[8:], q[30:70]])
    spans = [RowSpan(310, 1, long), RowSpan(at, 1, mine), RowSpan(0, 40, prompt)]
    assert torch.equal(row_of(spans, beside, 1), alone)


def test_a_slot_outside_the_cache_is_refused():
    ck, cv = caches(4 * BS, 1, 16)
    rows = PagedRows([RowSpan(0, 2, [9])], BS, torch.device("cpu"))  # block 9 is past the 4-block cache
    with pytest.raises(RuntimeError, match="out of range"):
        paged_attention(torch.randn(2, 1, 16), ck, cv, rows, 0.25)


@pytest.mark.parametrize("width", [96, 100, 1536])
def test_silu_mul_equals_torchs_in_float64_and_a_row_does_not_depend_on_the_others(width):
    gate_up = torch.randn(700, 2 * width, generator=torch.Generator().manual_seed(4)) * 6
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -88.0])
    got = silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(got.double(), torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-30)
    for rows in (1, 3, 33, 699):
        assert torch.equal(silu_mul(gate_up[:rows]), got[:rows]), rows
    assert torch.equal(silu_mul(gate_up[5:6]), got[5:6])


@pytest.mark.parametrize("width", [64, 100, 576])
def test_rms_norm_equals_the_references_in_float64_and_a_row_does_not_depend_on_the_others(width):
    """Our RMSNorm against the Hugging Face decoders' formula in float64, rows of every scale (and a row of
    zeros); [T, heads, D] as q/k norms call it; a row's bits the same alone, in a few rows or in hundreds."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(700, width, generator=g) * torch.logspace(-3, 3, 700).unsqueeze(1)
    x[3] = 0.0
    weight = torch.randn(width, generator=g)
    got = rms_norm(x, weight, 1e-5)
    x64 = x.double()
    expected = weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(got.double(), expected, rtol=2e-6, atol=1e-30)
    torch.testing.assert_close(got, F.rms_norm(x, (width,), weight, 1e-5), rtol=2e-6, atol=1e-30)
    for rows in (1, 3, 33, 699):
        assert torch.equal(rms_norm(x[:rows], weight, 1e-5), got[:rows]), rows
    assert torch.equal(rms_norm(x[5:6], weight, 1e-5), got[5:6])
    heads = rms_norm(x[:12].reshape(3, 4, width), weight, 1e-5)
    assert torch.equal(heads.reshape(12, width), got[:12])


@pytest.mark.parametrize("rotary_dim", [16, 64, 128, 256])
def test_a_positions_cos_and_sin_are_the_same_in_any_pass(rotary_dim):
    inv_freq = 10000.0 ** -(torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    positions = torch.randint(0, 100_000, (3000,), generator=torch.Generator().manual_seed(5))
    cos, sin = cos_sin(inv_freq, 1.0, positions, torch.float32)
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    torch.testing.assert_close(cos[:, : rotary_dim // 2].double(), torch.cos(angles.float().double()), rtol=0, atol=1e-6)
    for i in (0, 7, 2999):
        one, other = cos_sin(inv_freq, 1.0, positions[i : i + 1], torch.float32)
        assert torch.equal(one[0], cos[i]) and torch.equal(other[0], sin[i])


@pytest.mark.parametrize("dim", [32, 64, 80, 128])  # 80: a half of 40, a vector and a masked tail
def test_rope_equals_the_hugging_face_formula_bit_for_bit_on_rows_of_any_stride(dim):
    generator = torch.Generator().manual_seed(dim)
    qkv = torch.randn(9, 7 * dim, generator=generator) * 3
    x = qkv[:, : 5 * dim].reshape(9, 5, dim)  # q and k heads of a fused projection: rows 7 heads apart
    cos, sin = cos_sin(10000.0 ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0, torch.arange(9) * 37, torch.float32)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    expected = x * cos[:, None, :] + rotated * sin[:, None, :]  # transformers' apply_rotary_pos_emb
    got = torch.ops.lanes_quant.rope(x, cos, sin)
    assert torch.equal(got, expected)
    assert torch.equal(torch.ops.lanes_quant.rope(x[4:5], cos[4:5], sin[4:5]), got[4:5])


@pytest.mark.parametrize("vocab", [5, 16, 100, 49152])
def test_log_softmax_and_greedy_equal_torchs_and_share_their_bits(vocab):
    """Our log_softmax (cpu_softmax.cpp) against torch's in float64; the greedy op's argmax is torch's
    argmax (ties to the first position, a NaN wins, a row of -inf gives 0) and its logprob is the
    log_softmax value bit for bit; a row's values are the same alone or among others."""
    from lanes.backend.draws import log_softmax
    from lanes.gpu.graphs import greedy_draw

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(9, vocab, generator=g) * torch.logspace(-2, 2, 9).unsqueeze(1)
    logits[1, vocab // 2] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first one wins
    logits[2] = float("-inf")
    logits[3, vocab - 1] = float("nan")
    logits[4, :] = 3.0
    got = log_softmax(logits)
    expected = torch.log_softmax(logits.double(), dim=-1)
    finite = [0, 1, 4, 5, 6, 7, 8]
    torch.testing.assert_close(got[finite].double(), expected[finite], rtol=1e-6, atol=2e-6)
    assert got[2].isnan().all() and got[3].isnan().all()
    drawn = greedy_draw(logits)
    assert drawn[0].tolist() == logits.argmax(dim=-1).double().tolist()
    assert drawn[0, 1].item() == vocab // 2 and drawn[0, 2].item() == 0 and drawn[0, 3].item() == vocab - 1
    tokens = drawn[0].long()
    chosen = got.gather(1, tokens[:, None]).squeeze(1).double()
    assert torch.equal(drawn[1][finite], chosen[finite])
    for rows in (slice(0, 1), slice(5, 6), slice(4, 9)):
        assert torch.equal(log_softmax(logits[rows]), got[rows])
        assert torch.equal(greedy_draw(logits[rows]), drawn[:, rows])


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (6, 3, 80), (2, 1, 16)])
def test_rope_attention_is_rope_the_kv_write_and_attention_bit_for_bit(heads, kv_heads, d):
    """The fused attention part (rope_attention) against its parts run one by one: the rotated q and k,
    index_copy_ of k and v into their slots, paged_attention; the caches and the output the same bits."""
    from lanes.gpu.attention import rope_attention, write_kv

    ck, cv = caches(64 * BS, kv_heads, d)
    blocks = tables(3, 16)
    spans = [RowSpan(0, 37, blocks[0]), RowSpan(99, 1, blocks[1]), RowSpan(240, 9, blocks[2])]
    rows = PagedRows(spans, BS, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(47, (heads + 2 * kv_heads) * d, generator=g)
    positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in spans])
    cos, sin = cos_sin(10000.0 ** -(torch.arange(0, d, 2).float() / d), 1.0, positions, torch.float32)
    fused_k, fused_v = ck.clone(), cv.clone()
    got = rope_attention(qkv, cos, sin, fused_k, fused_v, rows, heads, d**-0.5)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = apply_rotary(q.reshape(47, heads, d), cos, sin)
    k = apply_rotary(k.reshape(47, kv_heads, d), cos, sin)
    write_kv(ck, cv, rows, k, v.reshape(47, kv_heads, d))
    expected = paged_attention(q, ck, cv, rows, d**-0.5).reshape(47, heads * d)
    assert torch.equal(fused_k, ck) and torch.equal(fused_v, cv)
    assert torch.equal(got, expected)
