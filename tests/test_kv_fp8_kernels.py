"""The fp8 KV cache in the decode path's Triton kernels: the RoPE + KV write quantizes exactly as torch's
float8 cast does, the paged attention kernel equals the gather reference over the dequantized cache and
stays within the format's stated bound of full-precision attention, and the fast step over an fp8 cache
equals the eager forward over it.

Rules: runs on CUDA where there is a GPU, else on the CPU under Triton's interpreter (TRITON_INTERPRET=1),
else skips; written bytes and exponents compared exactly; fp32 within 1e-5 relative (attention) and 1e-4
absolute (logits); bf16 within 1e-2 relative; fresh random inputs for every shape; the pool balanced.
"""

import os

import pytest
import torch

import scenario
import tiny
from lanes.core.passes import Piece
from lanes.gpu import fp8
from lanes.gpu.device import choose, cuda_device_count

if cuda_device_count() == 0 and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is not on (TRITON_INTERPRET=1)", allow_module_level=True)
DEVICE = "cuda" if cuda_device_count() else "cpu"
pytest.importorskip("triton")

from lanes.gpu import kernels  # noqa: E402
from lanes.gpu.attention import PagedRows, RowSpan, paged_attention  # noqa: E402
from lanes.loader import load_model  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def relative(mine: torch.Tensor, ref: torch.Tensor) -> float:
    return ((mine.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hq, hkv, d, rotary", [(1, 14, 2, 64, 64), (9, 4, 4, 32, 32), (5, 12, 2, 128, 64),
                                                         (7, 4, 1, 64, 16)])
def test_rope_write_quantizes_as_torch_casts_the_full_precision_write(dtype, tokens, hq, hkv, d, rotary):
    g = torch.Generator().manual_seed(tokens * d + rotary)
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * d, generator=g) * 4).to(DEVICE, dtype)
    qkv[0, (hq + hkv) * d : (hq + hkv + 1) * d] = 0  # a value head of zeros: the lowest exponent, zero values
    positions = torch.randint(0, 3000, (tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(256, generator=g)[:tokens].to(DEVICE)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))).to(DEVICE)
    full_k, full_v = (torch.zeros(256, hkv, d, device=DEVICE, dtype=dtype) for _ in range(2))
    q_full = kernels.rope_write_kv(qkv, positions, slots, inv_freq, 1.0, full_k, full_v, hq, hkv, d, rotary_dim=rotary)
    k8, v8 = (torch.zeros(256, hkv, d, device=DEVICE, dtype=fp8.FP8) for _ in range(2))
    k_exp, v_exp = (torch.zeros(256, hkv, device=DEVICE, dtype=torch.int8) for _ in range(2))
    q = kernels.rope_write_kv(qkv, positions, slots, inv_freq, 1.0, k8, v8, hq, hkv, d, rotary_dim=rotary,
                              k_exp=k_exp, v_exp=v_exp)
    assert torch.equal(q, q_full)  # q is never quantized
    for values, exps, full in ((k8, k_exp, full_k), (v8, v_exp, full_v)):
        want, want_exp = fp8.quantize(full[slots])
        assert torch.equal(exps[slots], want_exp)
        assert torch.equal(bytes_of(values[slots]), bytes_of(want))
        # torch's own cast of the value scaled by the exponent: the format is nothing but that
        scaled = full[slots].float() * torch.ldexp(torch.ones(want_exp.shape), -want_exp.int().cpu()).to(DEVICE)[..., None]
        assert torch.equal(bytes_of(values[slots]), bytes_of(scaled.to(torch.float8_e4m3fn)))
    assert v_exp[slots[0], 0].item() == fp8.LOWEST and not v8[slots[0], 0].float().any()
    untouched = torch.ones(256, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not bytes_of(k8[untouched]).any() and not k_exp[untouched].any() and not v_exp[untouched].any()


def paged_case(g, lanes, hq, hkv, d, lengths, dtype):
    blocks = 64
    k = (torch.randn(blocks * 16, hkv, d, generator=g) * 2).to(DEVICE, dtype)
    v = torch.randn(blocks * 16, hkv, d, generator=g).to(DEVICE, dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
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
    return q, k, v, table, lens, PagedRows(spans, 16, torch.device(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lanes, hq, hkv, d, lengths", [(1, 14, 2, 64, [1]), (3, 4, 4, 32, [5, 16, 17]),
                                                         (5, 8, 1, 64, [70, 3, 129, 64, 1]), (1, 14, 2, 64, [600])])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_fp8_paged_attention_equals_the_gather_reference_over_the_dequantized_cache(dtype, lanes, hq, hkv, d, lengths,
                                                                                    splits):
    g = torch.Generator().manual_seed(lanes * 100 + d + sum(lengths))
    q, k, v, table, lens, rows = paged_case(g, lanes, hq, hkv, d, lengths, dtype)
    (k8, k_exp), (v8, v_exp) = fp8.quantize(k), fp8.quantize(v)
    mine = kernels.paged_decode_attention(q, k8, v8, table, lens, d**-0.5, 16, tile=16, splits=splits,
                                          k_exp=k_exp, v_exp=v_exp)
    ref = paged_attention(q.float(), fp8.dequantize(k8, k_exp, torch.float32), fp8.dequantize(v8, v_exp, torch.float32),
                          rows, d**-0.5)
    eager = paged_attention(q, k8, v8, rows, d**-0.5, (k_exp, v_exp))  # the eager path over the same cache
    assert not torch.isnan(mine).any()
    assert relative(mine, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert relative(eager, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("lanes, hq, hkv, d, lengths", [(3, 4, 4, 32, [5, 16, 17]), (5, 8, 1, 64, [70, 3, 129, 64, 1])])
def test_fp8_attention_stays_within_the_formats_bound_of_full_precision(lanes, hq, hkv, d, lengths):
    """Every key and value element is off by at most 2^-4 of itself (or 2^(e-10) below e4m3's normals), so a
    score moves by at most delta = scale * 2^-4 * sum |q||k| (+ the subnormal term), every softmax weight by a
    factor within e^(+-2 delta), and each output element by at most
    (e^(2 delta) - 1) * sum_j p_j |v'_j| + sum_j p_j |v'_j - v_j|."""
    g = torch.Generator().manual_seed(lanes + d)
    q, k, v, table, lens, _ = paged_case(g, lanes, hq, hkv, d, lengths, torch.float32)
    (k8, k_exp), (v8, v_exp) = fp8.quantize(k), fp8.quantize(v)
    mine = kernels.paged_decode_attention(q, k8, v8, table, lens, d**-0.5, 16, tile=16, k_exp=k_exp, v_exp=v_exp)
    full = kernels.paged_decode_attention(q, k, v, table, lens, d**-0.5, 16, tile=16)
    v_back = fp8.dequantize(v8, v_exp, torch.float32)

    def element_bound(x, e):  # [S, Hkv, D]: the largest rounding error each element may have
        return torch.maximum(x.abs() * 2.0**-4, fp8.powers(e.to(torch.int32) - 10)[..., None])

    k_err, v_err = element_bound(k, k_exp), (v_back - v).abs()
    assert (v_err <= element_bound(v, v_exp)).all()
    group = hq // hkv
    for lane in range(lanes):
        n = int(lens[lane])
        slots = torch.cat([table[lane, b].long() * 16 + torch.arange(16, device=DEVICE) for b in range(-(-n // 16))])[:n]
        for head in range(hq):
            h = head // group
            qh = q[lane, head].double()
            scores = (k[slots, h].double() @ qh) * d**-0.5
            delta = ((k_err[slots, h].double() @ qh.abs()) * d**-0.5).max()
            p = torch.softmax(scores, dim=0)
            bound = (torch.exp(2 * delta) - 1) * (p @ v_back[slots, h].double().abs()) + p @ v_err[slots, h].double()
            error = (mine[lane, head].double() - full[lane, head].double()).abs()
            assert (error <= bound * (1 + 1e-4) + 1e-6).all(), (lane, head, (error - bound).max().item())


@pytest.mark.parametrize("kind, overrides, lanes", [
    ("qwen2", {}, [5, 17, 33]),
    ("glm4_moe", dict(num_hidden_layers=3, attention_bias=True, n_group=2, topk_group=1,
                      rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}), [5, 17]),
])
def test_the_fast_step_over_an_fp8_cache_equals_the_eager_forward_over_it(kind, overrides, lanes, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    tiny.build(kind, tmp_path, **overrides)
    model = load_model(tmp_path, choose(DEVICE, "fp32"), kv_blocks=64, quiet=True, kv_cache="fp8")
    assert model.decoder.kv.fp8
    pool, tables, lengths, tokens = scenario.lanes_after_prefill(model, lanes)
    dev, width = model.placement.device, 8
    for _ in range(3):
        pieces = [Piece(i, (tok,), n, tuple(t.blocks)) for i, (tok, n, t) in enumerate(zip(tokens, lengths, tables))]
        slots = [t.blocks[n // 16] * 16 + n % 16 for t, n in zip(tables, lengths)]
        table = [t.blocks + [model.decoder.kv.scratch_block] * (width - len(t.blocks)) for t in tables]
        fast = model.decoder.decode_step(torch.tensor(tokens, device=dev), torch.tensor(lengths, device=dev),
                                         torch.tensor(slots, device=dev), torch.tensor([n + 1 for n in lengths], device=dev),
                                         torch.tensor(table, device=dev))
        kv = model.decoder.kv
        written = (bytes_of(kv.data[:, :, slots]).clone(), kv.exponents[:, :, slots].clone())
        eager = model.decoder.forward(pieces)  # writes the same rows again, eagerly: the same bytes
        assert torch.equal(bytes_of(kv.data[:, :, slots]), written[0]) and torch.equal(kv.exponents[:, :, slots], written[1])
        torch.testing.assert_close(fast, eager, rtol=0, atol=1e-4)
        assert fast.argmax(-1).tolist() == eager.argmax(-1).tolist()
        tokens = eager.argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    for t in tables:
        t.clear(pool)
    pool.check_integrity()
