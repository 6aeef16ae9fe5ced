"""`lanes serve --tp 1` on a GPU: the same greedy completions as on the CPU, and a clean SIGTERM.

Rules: runs only where CUDA is (skipped otherwise); a tiny random Qwen2 built in the test, fp32 on both
devices (TF32 off in the server) so greedy tokens agree exactly; real server processes on 127.0.0.1 port 0;
every wait under `trio.fail_after`.
"""

import signal

import httpx
import pytest
import trio

import tiny
from lanes.gpu.device import cuda_device_count
from rank_helpers import start

pytestmark = pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")

PROMPTS = ["the cat", "a hat on the", "in the sun the"]


async def completions(url: str) -> list[list[str]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        out = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}
            answer = await http.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            out.append(answer.json()["choices"][0]["logprobs"]["tokens"])
        return out


async def test_serve_on_cuda_with_tp_1_equals_the_cpu_and_ends_on_sigterm(tmp_path):
    tiny.build("qwen2", tmp_path)
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            cpu = await start(nursery, tmp_path, "--tp", "1", name="cpu")
            gpu = await start(nursery, tmp_path, "--tp", "1", "--device", "cuda", name="cuda")
            expected = await completions(await cpu.until_serving())
            assert await completions(await gpu.until_serving()) == expected
            for served in (cpu, gpu):
                served.signal(signal.SIGTERM)
                assert await served.exit_code() == 0, served.text
    assert "capturing decode graphs" in gpu.text
