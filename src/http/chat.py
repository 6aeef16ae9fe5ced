"""POST /v1/chat/completions: the messages and tools rendered in the family's format, the answer held to
its grammar (response_format, vLLM's guided fields, a tool choice), submitted as n streams and answered as
one JSON object or as server-sent events, with tool calls parsed from the text as it streams.
"""

from __future__ import annotations

import dataclasses
import time
from typing import AsyncIterator

import trio

from ..core.stream import Finished, TokenEvent
from ..text.chat import ChatTemplateError
from ..tools import prompting
from ..tools.parser import ToolCallParser, parse as parse_calls
from . import errors, parse
from .exchange import Exchange
from .generation import Choice, collect
from .openai_api import check_model, finish_reason, stream_body, submit, token_text, usage, with_media
from .service import Service
from .structured import constrained, wanted_of
from .tool_calls import ToolRequest, call_id, delta_of, message_calls, new_parser, tool_request


async def chat_prompt(service: Service, messages: list[dict], tools: ToolRequest, template: dict, parts,
                      max_tokens: int, deadline: float):
    """The prompt ids (and media) of a chat with its tools, in the family's format."""
    tokenizer = service.tokenizer
    if tokenizer.chat_template is None:
        raise errors.no_chat_template()
    renders, offered = service.template_tools, tools.tools
    if offered and service.tool_system is not None:
        messages = service.tool_system.put_in_front(messages, offered, tokenizer)
        renders = dataclasses.replace(renders, tools=service.tool_system.template_takes_tools)
        offered = offered if renders.tools else None
        renders = dataclasses.replace(renders, tools=True)  # listed by the tool system already
    messages, offered = prompting.prepare(messages, offered, service.tool_format, renders)
    try:
        prompt = tokenizer.encode_chat(messages, tools=offered, **template)
    except ChatTemplateError as error:
        raise errors.chat_template(str(error)) from None
    return await with_media(service, prompt, parts, deadline, "messages", room_for=max_tokens)


def chat_logprob(service: Service, event: TokenEvent) -> dict:
    def entry(token: int, logprob: float) -> dict:
        text = token_text(service, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**entry(event.token, event.logprob), "top_logprobs": [entry(t.token, t.logprob) for t in event.top]}


async def chat_completions(service: Service, body: dict, exchange: Exchange):
    parts = []
    messages, common, template = parse.chat(body, service.vision, parts)
    model = check_model(service, body)
    tools = tool_request(body, parse.tools(body))
    deadline = exchange.deadline = trio.current_time() + service.request_timeout
    common = await constrained(service, common, wanted_of(body, tools, service.tool_format), deadline)
    prompt, media = await chat_prompt(service, messages, tools, template, parts, common.sampling.max_tokens or 0, deadline)
    exchange.prompt_tokens = len(prompt)
    streams = await submit(service, prompt, common, deadline, "messages", media)
    head = {"id": f"chatcmpl-{exchange.id}", "created": int(time.time()), "model": model}
    if common.stream:
        return chat_sse(service, streams, common, tools, head, deadline, exchange)
    choices = await collect(streams, deadline, exchange.timing)
    exchange.completion_tokens = sum(len(c.tokens) for c in choices)
    return {
        **head, "object": "chat.completion",
        "choices": [{"index": c.index, **answer(service, tools, c),
                     "logprobs": {"content": [chat_logprob(service, e) for e in c.logprobs]}
                     if common.sampling.logprobs else None} for c in choices],
        "usage": usage(len(prompt), exchange.completion_tokens, choices[0].cached_tokens),
        "system_fingerprint": None,
    }


def answer(service: Service, tools: ToolRequest, choice: Choice) -> dict:
    """A whole choice's message (its text, and its tool calls when the request offers tools) and finish."""
    text = "".join(choice.text)
    if not tools.parses:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": choice.finish_reason}
    parsed = parse_calls(service.tool_format, text)
    calls = message_calls(parsed, [call_id() for _ in parsed.calls])
    message = {"role": "assistant", "content": parsed.text or (None if calls else ""), "tool_calls": calls}
    called = calls and choice.finish_reason == "stop"
    return {"message": message, "finish_reason": "tool_calls" if called else choice.finish_reason}


def chat_sse(service, streams, common, tools: ToolRequest, head, deadline, exchange) -> AsyncIterator[str]:
    opening = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for index in range(len(streams))]
    parsers: list[ToolCallParser | None] = [new_parser(service.tool_format, tools) for _ in streams]
    ids: list[list[str]] = [[] for _ in streams]

    def deltas(index: int, text: str, end: bool = False) -> list[dict]:
        parser = parsers[index]
        if parser is None:
            return [{"content": text}] if text else []
        found = parser.push(text) + (parser.finish() if end else [])
        return [delta_of(d, ids[index]) for d in found]

    def token(index: int, event: TokenEvent) -> list[dict]:
        logprobs = {"content": [chat_logprob(service, event)]} if common.sampling.logprobs else None
        made = deltas(index, event.text)
        if not made and logprobs:
            made = [{}]
        return [{"index": index, "delta": d, "logprobs": logprobs if i == 0 else None, "finish_reason": None}
                for i, d in enumerate(made)]

    def finish(index: int, event: Finished) -> list[dict]:
        made = deltas(index, event.text, end=True)
        reason = finish_reason(event)
        if ids[index] and reason == "stop":
            reason = "tool_calls"
        last = {"index": index, "delta": made.pop() if made else {}, "logprobs": None, "finish_reason": reason}
        return [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in made] + [last]

    return stream_body(streams, common, {**head, "object": "chat.completion.chunk"}, deadline, exchange,
                       opening, token, finish)
