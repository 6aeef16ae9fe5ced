"""`--kv-cache fp8`: the format, the pool's bytes, and the eager path against transformers.

The reference is transformers' own forward with its attention's keys and values rounded through torch's
float8_e4m3fn cast (each token's head scaled by a power of two that puts its largest element in [128, 256)):
our logits equal it within 1e-4 and our greedy tokens are its; against the full-precision forward the
logits stay within the stated bound. Then a server with the flag: /v1/info, the prompt cache, drafts.

Rules: tiny random models built in the test; fp32 on the CPU; exact byte counts; the block pool balanced
after each test; live servers on 127.0.0.1 port 0 under `trio.fail_after` (the lane core's books checked at
each stop).
"""

import argparse
import contextlib

import httpx
import pytest
import torch
import trio

import scenario
import tiny
from lanes.core.blocks import BlockPool, blocks_within
from lanes.flags import add_serve_flags
from lanes.gpu import fp8
from lanes.gpu.device import choose
from lanes.gpu.kv import KV_CACHES, KVShape
from lanes.loader import load_model
from lanes.quant import weight
from lanes.serve import build_service
from server_helpers import serving

CASES = {
    "llama": ("llama", {}),
    "qwen2-one-kv-head": ("qwen2", dict(num_key_value_heads=1)),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=24)),
    "glm4_moe-partial-rotary": ("glm4_moe", dict(num_hidden_layers=3, n_group=2, topk_group=1, attention_bias=True,
                                                  rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                                                   "partial_rotary_factor": 0.25})),
}
FULL_PRECISION_BOUND = 0.35  # each logits row's relative error (L2) against the fp32 cache, dense tiny families


def test_values_are_torchs_cast_of_each_head_scaled_into_128_256_and_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-30, 30, 50)[:, None, None]
    x[0, 0] = 0.0
    x[1, 1, 5] = 1e-30  # tiny elements of a big head land among e4m3's subnormals
    values, e = fp8.quantize(x)
    amax = x.abs().amax(-1)
    _, mant_exp = torch.frexp(amax)
    want = torch.where(amax > 0, mant_exp - 8, torch.full_like(mant_exp, fp8.LOWEST)).clamp(fp8.LOWEST, fp8.HIGHEST)
    assert torch.equal(e.long(), want.long())
    scaled = x * torch.ldexp(torch.ones(e.shape), -e.int())[..., None]
    assert torch.equal(values.view(torch.uint8), scaled.to(torch.float8_e4m3fn).view(torch.uint8))
    top = values.float().abs().amax(-1)
    assert ((top >= 128) & (top <= 256))[amax > 0].all() and top[0, 0] == 0
    back = fp8.dequantize(values, e, torch.float32)
    step = torch.maximum(x.abs() * 2.0**-4, torch.ldexp(torch.ones(e.shape), e.int() - 10)[..., None])
    assert ((back - x).abs() <= step).all()


def test_bytes_per_block_and_the_blocks_a_budget_holds():
    shape = KVShape(layers=30, kv_heads=3, head_dim=64, block_size=16)  # the default model's
    assert shape.bytes_per_block(torch.float32) == 2 * 30 * 16 * 3 * 64 * 4 == 737280
    assert shape.bytes_per_block(torch.bfloat16) == 368640
    assert shape.bytes_per_block(fp8.FP8) == 2 * 30 * 16 * 3 * (64 + 1) == 187200  # 0.508 of bf16, 0.254 of fp32
    assert blocks_within(2 << 30, 187200) == 11471 and blocks_within(2 << 30, 737280) == 2912
    assert blocks_within(10, 187200) == 1
    with pytest.raises(ValueError):
        blocks_within(10, 0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-fp8")
    tiny.build("llama", folder, max_position_embeddings=512)
    return folder


def test_a_byte_budget_holds_the_fp8_cache_in_more_blocks(folder):
    full = load_model(folder, choose("cpu", "fp32"), kv_bytes=1 << 20, quiet=True)
    small = load_model(folder, choose("cpu", "fp32"), kv_bytes=1 << 20, quiet=True, kv_cache="fp8")
    # 2 layers, 2 KV heads of 16: 8192 bytes a block in fp32, 2 * 2 * 16 * 2 * 17 = 2176 in fp8
    assert (full.decoder.kv.bytes_per_block, small.decoder.kv.bytes_per_block) == (8192, 2176)
    assert (full.kv_blocks, small.kv_blocks) == (128, 481)
    kv = small.decoder.kv
    assert kv.data.dtype == torch.float8_e4m3fn and kv.exponents.shape == (2, 2, 482 * 16, 2)
    assert kv.describe() == {"dtype": "float8_e4m3fn", "scale": "a power of two for each token's head",
                             "bytes_per_block": 2176, "bytes": 2176 * 481}
    with pytest.raises(ValueError, match="kv_cache must be one of auto, fp8"):
        load_model(folder, choose("cpu", "fp32"), kv_blocks=4, quiet=True, kv_cache="fp16")


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]: each token's head through torch's e4m3 cast, scaled so its largest element is in [128, 256)."""
    _, e = torch.frexp(x.abs().amax(-1, keepdim=True))
    scale = torch.ldexp(torch.ones_like(x[..., :1]), e - 8)
    return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale


@contextlib.contextmanager
def keys_and_values_rounded(model):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, rounded(key), rounded(value), *args, **kwargs)

    AttentionInterface.register("fp8_kv_reference", attention)
    model.set_attn_implementation("fp8_kv_reference")
    try:
        yield model
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_logits_equal_transformers_with_rounded_keys_and_values(case, tmp_path, monkeypatch):
    # an e4m3 step is 1/16: an ulp of another summation order at a rounding edge moves a key a whole step, so
    # the products keep the routing this reference was checked under (16 rows; other CPUs' thresholds tested apart)
    monkeypatch.setattr(weight, "few_rows", lambda: weight.FEW_ROWS)
    kind, overrides = CASES[case]
    reference = tiny.build(kind, tmp_path, **overrides)
    model = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=64, quiet=True, kv_cache="fp8")
    pool = BlockPool(model.kv_blocks)
    prompt_ids = scenario.prompts(model.config.vocab_size)
    ours = scenario.run(model.decoder, pool, prompt_ids)
    with keys_and_values_rounded(reference):
        theirs = scenario.reference(reference, prompt_ids, ours[2], steps=16)
    for mine, ref in zip(ours[0] + ours[1], theirs[0] + theirs[1], strict=True):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-4)
    scenario.assert_same_greedy(prompt_ids, ours, theirs)
    if not kind.endswith("moe"):  # against the full-precision forward: within the stated bound
        full = scenario.reference(reference, prompt_ids, ours[2], steps=16)
        for mine, ref in zip(ours[0] + ours[1], full[0] + full[1], strict=True):
            assert ((mine - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < FULL_PRECISION_BOUND
    pool.check_integrity()
    assert pool.free == pool.total


def flags(*more: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return parser.parse_args(list(more))


def test_the_flag_parser_refuses_other_caches(capsys):
    assert flags("--kv-cache", "fp8").kv_cache == "fp8" and flags().kv_cache == "auto"
    assert KV_CACHES == ("auto", "fp8")  # the flag's choices are the loader's
    with pytest.raises(SystemExit) as exited:
        flags("--kv-cache", "fp16")
    assert exited.value.code == 2
    assert "argument --kv-cache: invalid choice: 'fp16' (choose from 'auto', 'fp8')" in capsys.readouterr().err


async def completions(service, bodies: list[dict]) -> tuple[list[dict], dict]:
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with trio.fail_after(120):
                replies = [(await http.post("/v1/completions", json=body)).json() for body in bodies]
                info = (await http.get("/v1/info")).json()
    return replies, info


async def test_an_fp8_server_reports_its_cache_restores_cached_prefixes_and_drafts_without_changing_a_token(folder):
    document = " ".join(f"the cat {i} sat on the mat" for i in range(12))
    body = dict(prompt=document + " and the hat", max_tokens=16, temperature=0, logprobs=1)
    bodies = [body, body, {**body, "prompt": "on the mat", "logit_bias": {"20": 100}}]  # the last repeats: drafts fit
    base = ["--model", str(folder), "--device", "cpu", "--lanes", "2", "--max-model-len", "256", "--kv-cache", "fp8"]
    plain, info = await completions(build_service(flags(*base)), bodies)
    assert info["kv_cache"] == {"dtype": "float8_e4m3fn", "scale": "a power of two for each token's head",
                                "bytes_per_block": 2176, "bytes": 2176 * info["kv_blocks"]["total"]}
    prompt_tokens = plain[0]["usage"]["prompt_tokens"]
    assert plain[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16 > 0
    assert plain[1]["choices"][0]["text"] == plain[0]["choices"][0]["text"]
    assert len(set(plain[0]["choices"][0]["logprobs"]["tokens"])) > 2  # a text, not one token over and over
    assert info["prompt_cache"]["budget_bytes"] == info["kv_blocks"]["total"] * 2176 // 2
    drafted, info = await completions(build_service(flags(*base, "--draft", "ngram", "--draft-tokens", "4",
                                                          "--draft-lengths", "fixed")), bodies)
    assert info["drafts"]["accepted"] > 0
    for got, want in zip(drafted, plain, strict=True):
        assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
        assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)


async def test_two_ranks_over_gloo_with_an_fp8_cache_answer_as_one_rank(tmp_path):
    """Each rank quantizes its own KV heads, each head by its own exponent: the shards' caches are the
    single rank's, split."""
    import signal

    from rank_helpers import start_two_ranks
    from server_helpers import torch_service

    tiny.build("qwen2", tmp_path, max_position_embeddings=512)
    body = dict(prompt="the cat sat on the mat in the hat", max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    model = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=200, quiet=True, kv_cache="fp8")
    (want,), _ = await completions(torch_service(model, lanes=4, max_model_len=512), [body])
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            rank0, rank1, url = await start_two_ranks(nursery, tmp_path, "--lanes", "4", "--kv-cache", "fp8")
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                got = (await http.post("/v1/completions", json=body)).json()
                info = (await http.get("/v1/info")).json()
            rank0.signal(signal.SIGTERM)
            assert await rank0.exit_code() == 0, rank0.text
            assert await rank1.exit_code() == 0, rank1.text
    assert info["tp"] == 2 and info["kv_cache"]["dtype"] == "float8_e4m3fn"
    assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
    assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
