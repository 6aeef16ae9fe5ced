"""The prompt cache's counters as the server exports them: a server built from `lanes serve`'s own flags with
a small `--prompt-cache-bytes` is driven through a known sequence (a miss and a keep, a hit, a miss whose keep
evicts, a miss of what was evicted), and /metrics and /v1/info must say exactly what happened.

Rules: a live server on 127.0.0.1 port 0; a tiny random model built in the test; prompts as token ids so every
block is known; one lane, requests one after another; every test under `trio.fail_after`; the lane core's
integrity (pool and cache) checked when the server stops.
"""

import argparse

import httpx
import trio

import tiny
from lanes.flags import add_serve_flags
from lanes.serve import build_service
from server_helpers import serving

BLOCK = 16


def kv_bytes_per_block(config) -> int:
    """K and V of one 16-token block over every layer, in fp32: what the cache charges a block."""
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * BLOCK * config.num_key_value_heads * head_dim * 4


def scrape(text: str) -> dict[str, float]:
    """The prompt cache's series, each carrying the served model's name (its folder's)."""
    series = {}
    for line in text.splitlines():
        if line.startswith("lanes_prompt_cache"):
            name, value = line.split(" ")
            assert name.endswith('{model_name="model"}'), name
            series[name.removesuffix('{model_name="model"}')] = float(value)
    return series


async def test_metrics_count_misses_hits_evictions_and_held_bytes_exactly(tmp_path):
    reference = tiny.build("llama", tmp_path / "model")
    per_block = kv_bytes_per_block(reference.config)
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args(["--model", str(tmp_path / "model"), "--device", "cpu", "--lanes", "1",
                              "--max-model-len", "256", "--prompt-cache-bytes", str(3 * per_block)])
    service = build_service(args)
    assert service.core.cache.bytes_per_block == per_block
    a = list(range(10, 10 + 3 * BLOCK + 1))  # three full blocks and one row to run
    b = list(range(100, 100 + 3 * BLOCK + 1))
    answers = []
    with trio.fail_after(60):
        async with serving(service) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                for prompt in (a, a, b, a):
                    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
                    answers.append((await http.post("/v1/completions", json=body)).json())
                metrics = scrape((await http.get("/metrics")).text)
                info = (await http.get("/v1/info")).json()["prompt_cache"]
            service.core.cache.check_integrity()
    cached = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers]
    # a: miss, kept; a: hit; b: miss, its keep evicts a's three blocks; a: miss again
    assert cached == [0, 3 * BLOCK, 0, 0]
    assert metrics == {
        "lanes_prompt_cache_hits_total": 1.0,
        "lanes_prompt_cache_misses_total": 3.0,
        "lanes_prompt_cache_hit_tokens_total": 3.0 * BLOCK,
        "lanes_prompt_cache_evictions_total": 6.0,  # b's keep took a's three blocks, a's last keep took b's
        "lanes_prompt_cache_held_bytes": 3.0 * per_block,
        "lanes_prompt_cache_entries": 3.0,
    }
    assert info == {"held_bytes": 3 * per_block, "budget_bytes": 3 * per_block, "entries": 3, "hits": 1, "misses": 3}
