"""The prompt cache through the server: a shared 1,000-token prefix is restored for the second request,
which reports it in `usage.prompt_tokens_details.cached_tokens` and answers the same text; `--tool-system`
is warmed into the cache at start-up and restored by requests that carry tools; /metrics counts hits.

Rules: live servers on 127.0.0.1 port 0; a tiny random model built in the test; every test under
`trio.fail_after`; the lane core's integrity (pool and cache) checked when each server stops.
"""

import httpx
import pytest

import tiny
from golden_server import HELLO
from lanes.core.lane_core import LaneCore
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import CpuRunner, choose
from lanes.http.service import Service
from lanes.http.tool_system import ToolSystem
from lanes.loader import load_model
from server_helpers import serving

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny.build("llama", folder, max_position_embeddings=2048)
    return load_model(folder, choose("cpu", "fp32"), kv_blocks=600, quiet=True)


def cached_service(model, tool_system=None) -> Service:
    backend = TorchBackend(model, CpuRunner(), lanes=2, max_model_len=2048)
    core = LaneCore(backend, text_factory(model.tokenizer), (), max_rows=512, cache_bytes=300 * backend.shape.bytes_per_block)
    return Service(core, model.tokenizer, "tiny", "llama", 2048, vocab_size=model.config.vocab_size, tool_system=tool_system)


async def test_a_shared_1000_token_prefix_is_restored_and_gives_the_same_text(tiny_model):
    document = " ".join(f"fact {i} is the cat" for i in range(1, 64))
    body = {"messages": [{"role": "system", "content": document}, {"role": "user", "content": "the hat"}],
            "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    async with serving(cached_service(tiny_model)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            first = (await http.post(CHAT, json=body)).json()
            second = (await http.post(CHAT, json=body)).json()
            metrics = (await http.get("/metrics")).text
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 1000
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    counters = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("lanes_prompt_cache"))
    assert float(counters['lanes_prompt_cache_hits_total{model_name="tiny"}']) == 1.0
    assert float(counters['lanes_prompt_cache_hit_tokens_total{model_name="tiny"}']) == (prompt_tokens - 1) // 16 * 16


async def test_the_tool_system_prompt_is_warmed_at_start_up_and_restored_by_tools_requests(tiny_model, tmp_path):
    (tmp_path / "tools.txt").write_text(" ".join(f"rule {i}: answer with the hat" for i in range(60)))
    tool_system = ToolSystem.load(tmp_path / "tools.txt", tiny_model.tokenizer)
    service = cached_service(tiny_model, tool_system)
    warm_tokens = len(tool_system.warm_tokens(tiny_model.tokenizer)) // 16 * 16
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while (await http.get("/v1/info")).json()["prompt_cache"]["entries"] * 16 < warm_tokens:
                pass  # the warm pass runs in the background on the idle engine
            reply = (await http.post(CHAT, json={"messages": HELLO, "tools": tools, "max_tokens": 2})).json()
            plain = (await http.post(CHAT, json={"messages": HELLO, "max_tokens": 2})).json()
    assert warm_tokens > 300
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm_tokens - 16
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no tools: no tool system prompt
