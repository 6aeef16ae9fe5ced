"""The server driven by the official `openai` client: chat streaming and not, completions with echo and
logprobs, n=2, stop strings, and a stream closed early freeing its lane once the passes in flight settle.

Rules: a live server on 127.0.0.1 port 0 in the test's nursery; a tiny random model built in the test;
the client runs in a worker thread (it is synchronous); references are transformers' forward and
generate() on the same token ids; every test under `trio.fail_after`; the lane core's integrity and a
balanced block pool checked when each server stops.
"""

import httpx
import pytest
import torch
import trio

import tiny
from lanes.core.stream import Stream
from lanes.gpu.device import choose
from lanes.loader import load_model
from server_helpers import client, serving, torch_service

QUESTION = [{"role": "user", "content": "the cat in the hat"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    reference = tiny.build("qwen2", folder, max_position_embeddings=512)
    return load_model(folder, choose("cpu", "fp32"), kv_blocks=256, quiet=True), reference


def greedy_reference(reference, prompt: list[int], n: int) -> list[int]:
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


async def in_thread(fn):
    return await trio.to_thread.run_sync(fn)


async def test_chat_non_streaming_and_streaming_equal_transformers_greedy(tiny_model):
    model, reference = tiny_model
    prompt = model.tokenizer.encode_prompt(model.tokenizer.render_chat(QUESTION))
    expected = greedy_reference(reference, prompt, 8)
    async with serving(torch_service(model)) as url:
        c = client(url)
        reply = await in_thread(lambda: c.chat.completions.create(
            model="tiny", messages=QUESTION, temperature=0, max_tokens=8, extra_body={"ignore_eos": True}))
        assert reply.choices[0].message.content == model.tokenizer.decode(expected)
        assert reply.choices[0].finish_reason == "length"
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 8)

        def stream():
            chunks = list(c.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=8,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}))
            return chunks

        chunks = await in_thread(stream)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == reply.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []


async def test_completions_echo_with_prompt_logprobs_equal_transformers(tiny_model):
    model, reference = tiny_model
    prompt_text = "the cat sat on the mat"
    ids = model.tokenizer.encode(prompt_text)
    async with serving(torch_service(model)) as url:
        c = client(url)
        reply = await in_thread(lambda: c.completions.create(model="tiny", prompt=prompt_text, max_tokens=4, temperature=0,
                                                             echo=True, logprobs=2, extra_body={"ignore_eos": True}))
    choice = reply.choices[0]
    generated = greedy_reference(reference, ids, 4)
    assert choice.text == prompt_text + model.tokenizer.decode(generated)
    with torch.no_grad():
        full = reference(torch.tensor([ids + generated])).logits[0].log_softmax(-1)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [full[i - 1, t].item() for i, t in enumerate(ids + generated) if i > 0]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert len(lp.tokens) == len(ids) + 4
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])  # keyed by text: byte tokens may collide
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


async def test_n_equals_2_with_a_seed_is_reproducible_and_stop_strings_cut(tiny_model):
    model, _ = tiny_model
    async with serving(torch_service(model)) as url:
        c = client(url)

        def two():
            return c.chat.completions.create(model="tiny", messages=QUESTION, n=2, seed=11, temperature=1.0,
                                             max_tokens=12, extra_body={"ignore_eos": True})

        first, again = await in_thread(two), await in_thread(two)
        texts = [ch.message.content for ch in first.choices]
        assert [ch.index for ch in first.choices] == [0, 1]
        assert texts == [ch.message.content for ch in again.choices]
        assert texts[0] != texts[1]
        assert first.usage.completion_tokens == 24
        full = texts[0]
        stop = full[3:6]
        cut = await in_thread(lambda: c.chat.completions.create(
            model="tiny", messages=QUESTION, seed=11, temperature=1.0, max_tokens=12, stop=[stop],
            extra_body={"ignore_eos": True}))
        assert cut.choices[0].message.content == full[: full.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


async def test_closing_a_stream_early_frees_its_lane_once_the_passes_in_flight_settle(tiny_model, monkeypatch):
    model, _ = tiny_model
    service = torch_service(model, lanes=2)
    passes_at_cancel = []
    aclose = Stream.aclose

    async def seen(stream):  # the pass count when the server, having seen the close, closes the stream
        passes_at_cancel.append(service.core.statistics().passes)
        await aclose(stream)

    monkeypatch.setattr(Stream, "aclose", seen)
    async with serving(service) as url:
        c = client(url)

        def read_two_then_close():
            with c.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=200, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}) as stream:
                for _, chunk in zip(range(3), stream):
                    pass

        await in_thread(read_two_then_close)
        async with httpx.AsyncClient(base_url=url) as http:
            while (info := (await http.get("/v1/info")).json())["lanes_busy"]:
                pass
        assert passes_at_cancel  # closed once or more (closing is idempotent)
        # the pass in flight and the one planned ahead of it settle, then the boundary frees the lane
        assert service.core.statistics().passes - passes_at_cancel[0] <= 2
        assert service.core.statistics().streams_cancelled == 1
        assert service.core.statistics().tokens_out < 200
        assert info["kv_blocks"]["free"] == info["kv_blocks"]["total"]
