"""The routes vLLM users reach for beside chat and completions: the model by id, a real `created`, the
request id a client sends back in `x-request-id` and the log line, vLLM's root tokenizer routes, /metrics
with the model's name on every series and the KV usage, and streamed completions' `text_offset`.

Rules: live servers on 127.0.0.1 port 0 over a tiny transformers checkpoint or the fake backend; the
official `openai` client where it has the call; exact assertions; books checked when each server stops.
"""

import json
import logging
import re
import time
from functools import partial

import httpx
import pytest
import trio

import tiny
from golden_server import HELLO, fake_service
from lanes.gpu.device import choose
from lanes.loader import load_model
from server_helpers import client, serving, torch_service


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny.build("llama", folder, max_position_embeddings=512)
    return load_model(folder, choose("cpu", "fp32"), kv_blocks=400, quiet=True)


async def test_the_model_by_id_and_its_created_time_through_the_openai_client(tmp_path):
    import openai

    before = int(time.time())
    service, _ = fake_service(tmp_path)
    async with serving(service) as url:
        api = client(url, timeout=10)

        def calls():
            with pytest.raises(openai.NotFoundError) as missing:
                api.models.retrieve("gpt-9")
            return api.models.retrieve("tiny"), api.models.list().data, missing.value.body

        with trio.fail_after(30):
            model, listed, missing = await trio.to_thread.run_sync(calls)
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "lanes")
    assert before <= model.created <= int(time.time()) and [m.created for m in listed] == [model.created]
    assert missing["code"] == "model_not_found"


async def test_a_clients_request_id_comes_back_and_names_its_log_line_and_ours_is_given_otherwise(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lanes.http")
    service, _ = fake_service(tmp_path)
    body = {"messages": HELLO, "max_tokens": 2}
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            theirs = await http.post("/v1/chat/completions", json=body, headers={"x-request-id": "trace-7f3a:1"})
            ours = await http.post("/v1/chat/completions", json=body)
            spaced = await http.get("/health", headers={"x-request-id": "two words"})  # no log line could hold it
    lines = [r.getMessage() for r in caplog.records if r.name == "lanes.http"]
    assert theirs.headers["x-request-id"] == "trace-7f3a:1" and theirs.json()["id"] == "chatcmpl-trace-7f3a:1"
    assert re.fullmatch("[0-9a-f]{24}", ours.headers["x-request-id"]) and ours.json()["id"].endswith(ours.headers["x-request-id"])
    assert re.fullmatch("[0-9a-f]{24}", spaced.headers["x-request-id"])
    assert [line.split(" ", 2)[:2] for line in lines] == [["trace-7f3a:1", "chat"], [ours.headers["x-request-id"], "chat"],
                                                           [spaced.headers["x-request-id"], "health"]]


async def test_vllms_root_tokenizer_routes_answer_as_vllm_does(tiny_model):
    tokenizer = tiny_model.tokenizer
    async with serving(torch_service(tiny_model)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            info = (await http.get("/tokenizer_info")).json()
            plain = (await http.post("/tokenize", json={"prompt": "the cat", "add_special_tokens": False,
                                                        "return_token_strs": True})).json()
            chat = (await http.post("/tokenize", json={"model": "tiny", "messages": HELLO,
                                                       "add_generation_prompt": False})).json()
            text = (await http.post("/detokenize", json={"tokens": plain["tokens"]})).json()
    ids = tokenizer.encode("the cat", add_special_tokens=False)
    assert plain == {"tokens": ids, "count": len(ids), "max_model_len": 256,
                     "token_strs": [tokenizer.id_to_token(t) for t in ids]}
    assert chat["tokens"] == tokenizer.encode_chat(HELLO, add_generation_prompt=False) and text == {"prompt": "the cat"}
    assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == ("<|im_end|>", "<s>", 256)
    assert info["chat_template"] == tokenizer.chat_template.source and info["tokenizer_class"]


async def test_metrics_name_the_model_on_every_series_and_report_the_kv_usage(tmp_path):
    service, backend = fake_service(tmp_path, lanes=1, blocks=64)
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            entered, release = backend.hold()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(http.post, "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3}))
                await entered.wait()  # the stream holds its blocks inside a held pass
                busy = (await http.get("/metrics")).text
                held = 64 - service.core.statistics().blocks_free
                release.set()
            idle = (await http.get("/metrics")).text
    series = [line for line in busy.splitlines() if line and not line.startswith("#")]
    assert series and all('model_name="tiny"' in line for line in series)

    def usage(text: str) -> float:
        return float(re.search(r'^lanes_kv_usage_fraction\{model_name="tiny"\} (\S+)$', text, re.M).group(1))

    assert held == 2 and usage(busy) == held / 64  # the prompt and its 3 tokens: two blocks reserved
    assert usage(idle) == 0.0


async def test_streamed_completions_count_text_offset_over_the_whole_text_as_the_whole_answer_does(tiny_model):
    body = {"prompt": "the cat sat on", "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True,
            "ignore_eos": True}
    async with serving(torch_service(tiny_model)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            whole = (await http.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
            offsets, tokens = [], []
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        logprobs = json.loads(line[6:])["choices"][0]["logprobs"]
                        if logprobs:
                            offsets += logprobs["text_offset"]
                            tokens += logprobs["tokens"]
    generated = len(tokens)
    assert generated == 8 and tokens == whole["tokens"][-generated:]
    assert offsets == whole["text_offset"][-generated:]  # not restarting at 0 in every chunk
    assert offsets == sorted(offsets) and offsets[0] == len("".join(whole["tokens"][:-generated]))


@pytest.mark.parametrize("fault, status, code", [(RuntimeError("a bug"), 500, "internal_error"),
                                                 (MemoryError(), 503, "out_of_memory")])
async def test_a_handler_that_fails_answers_in_openais_shape_and_is_counted_as_what_it_answered(
        tmp_path, monkeypatch, fault, status, code):
    from server_helpers import counted

    service, _ = fake_service(tmp_path)

    def fails(*args, **kwargs):
        raise fault

    monkeypatch.setattr(service.tokenizer, "encode", fails)
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            answer = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            health = await http.get("/health")
    assert answer.status_code == status and answer.json()["error"]["code"] == code
    assert "Traceback" not in answer.text and health.status_code == 200
    assert counted(service, "completions", status) == 1 and counted(service, "completions", 499) == 0


async def test_metrics_report_the_backends_pass_times(tmp_path):
    from lanes.core.fake import FakeBackend, fake_text
    from lanes.core.lane_core import LaneCore
    from lanes.core.metered import MeteredBackend
    from lanes.http.service import Service

    service, _ = fake_service(tmp_path)
    metered = MeteredBackend(FakeBackend(lanes=2, blocks=64, max_model_len=64))
    core = LaneCore(metered, fake_text, [1])
    service = Service(core, service.tokenizer, "tiny", "fake", 64, pass_times=metered.statistics)
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
            text = (await http.get("/metrics")).text
    total = re.search(r'^lanes_backend_pass_seconds_total\{model_name="tiny"\} (\S+)$', text, re.M)
    longest = re.search(r'^lanes_backend_pass_seconds_max\{model_name="tiny"\} (\S+)$', text, re.M)
    assert metered.statistics().passes == 3 and total and longest
    assert float(total.group(1)) == pytest.approx(metered.statistics().seconds_total)
    assert 0 < float(longest.group(1)) <= float(total.group(1))
