"""Streamed answers' bytes: the events that wait together go out as one batch of chunks, each chunk the one
OpenAI's shape gives a single token, byte for byte what `json.dumps` of the whole chunk writes.

Rules: streams on real event channels fed by the test (no lane core: the bytes are what is checked), the
service of the golden tests' fake server for its tokenizer; every wait under `trio.fail_after`.
"""

import json

import trio

from golden_server import fake_service
from lanes.core.events import EventChannel
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Finished, Stream, TokenEvent
from lanes.http.chat import chat_sse
from lanes.http.exchange import Exchange
from lanes.http.openai_api import completion_sse
from lanes.http.parse import Common
from lanes.http.tool_calls import ToolRequest


def waiting_stream(events) -> Stream:
    channel = EventChannel()
    for event in events:
        channel.send_nowait(event)
    channel.close_sender()
    return Stream(7, channel, lambda _: None)


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


async def read_all(body) -> list[bytes]:
    with trio.fail_after(5):
        try:
            return [chunk async for chunk in body]
        finally:
            await body.aclose()


HEAD = {"id": "cmpl-x", "created": 1, "model": "tiny"}
TEXTS = ["He", "llo \"wo\"", "rld ü\n\x01\t\u2028\\ 😀"]


async def test_tokens_waiting_together_are_one_batch_of_per_token_completion_chunks(tmp_path):
    service, _ = fake_service(tmp_path)
    events = [TokenEvent(5, text) for text in TEXTS] + [Finished("length", "!", 3, 3)]
    common = Common(SamplingParams(max_tokens=3), 1, True, True)
    exchange = Exchange(service, "completions")
    exchange.prompt_tokens = 3
    body = completion_sse(service, [waiting_stream(events)], common, HEAD, exchange, [""], [0])
    head = {**HEAD, "object": "text_completion"}
    chunks = await read_all(body)
    assert chunks == [
        b"".join(sse({**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]})
                 for text in TEXTS) + sse({**head, "choices": [{"index": 0, "text": "!", "logprobs": None,
                                                                 "finish_reason": "length"}]}),
        sse({**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                             "prompt_tokens_details": {"cached_tokens": 0}}}) + b"data: [DONE]\n\n",
    ]
    assert exchange.completion_tokens == 3


async def test_chat_deltas_waiting_together_are_one_batch_of_per_token_chunks(tmp_path):
    service, _ = fake_service(tmp_path)
    events = [TokenEvent(5, text) for text in TEXTS] + [Finished("stop", "", 3, 3)]
    common = Common(SamplingParams(max_tokens=9), 1, True, False)
    body = chat_sse(service, [waiting_stream(events)], common, ToolRequest(None, "none", True), HEAD,
                    Exchange(service, "chat"))
    head = {**HEAD, "object": "chat.completion.chunk"}

    def chunk(delta, reason=None):
        return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]})

    assert await read_all(body) == [
        chunk({"role": "assistant", "content": ""}),
        b"".join(chunk({"content": text}) for text in TEXTS) + chunk({}, "stop"),
        b"data: [DONE]\n\n",
    ]
