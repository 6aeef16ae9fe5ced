"""POST /v1/responses, as vLLM serves OpenAI's Responses API: `input` items (messages, function calls and
their outputs) and `instructions` rendered as a chat, function tools and `text.format` held by the same
grammars as chat, `previous_response_id` from the in-memory store; answered whole or as its events
(`responses_stream`).
"""

from __future__ import annotations

import time
from typing import Any

import trio

from . import errors, parse, structured
from .chat import chat_prompt
from .exchange import Exchange
from .generation import collect
from .openai_api import check_model, submit
from .parse_messages import ROLES
from .responses_shapes import call_item, message_item, new_id, response_object, store, usage
from .responses_stream import events
from .service import Service
from .tool_calls import ToolRequest, tool_request
from ..tools.parser import parse as parse_calls

FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
          "temperature", "top_p", "stream", "previous_response_id", "store", "text", "metadata", "user", "truncation",
          "include", "reasoning", "top_k", "seed", "stop", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "min_p", "service_tier", "prompt_cache_key"}
SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "min_p", "user")


def check(body: dict) -> None:
    for key in body:
        if key not in FIELDS:
            raise errors.unknown_parameter(key)
    if body.get("reasoning") is not None:
        raise errors.unsupported("reasoning")
    if body.get("include"):
        raise errors.unsupported("include")
    if body.get("truncation") not in (None, "disabled"):
        raise errors.unsupported("truncation")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise errors.unsupported("service_tier")


def text_of(content: Any, where: str) -> str:
    """An input item's content as text: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise errors.wrong_type(where, "a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise errors.unsupported(f"{where}[{j}].type")
        else:
            raise errors.wrong_type(f"{where}[{j}]", "an input_text or output_text part")
    return "".join(texts)


def input_items(body: dict) -> list[dict]:
    raw = body.get("input")
    if raw is None:
        raise errors.missing("input")
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise errors.wrong_type("input", "a string or a non-empty list of input items")
    if not all(isinstance(item, dict) for item in raw):
        raise errors.wrong_type("input", "a string or a non-empty list of input items")
    return raw


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Responses items as chat messages: consecutive function calls one assistant turn, outputs tool messages."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise errors.unknown_role(f"{where}.role", ROLES)
            messages.append({"role": role, "content": text_of(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise errors.wrong_type(f"{where}.{key}", "a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise errors.wrong_type(f"{where}.call_id", "a string")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": text_of(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's notes: nothing this server's models read
        else:
            raise errors.unsupported(f"{where}.type")
    return messages


def chat_tools(body: dict) -> list[dict] | None:
    """Responses' flat function tools as chat's ({"type", "function": {...}}), checked as chat checks them."""
    raw = body.get("tools")
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise errors.wrong_type("tools", "a list of tools")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise errors.unsupported(f"tools[{i}].type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        tools.append({"type": "function", "function": function})
    return parse.tools({"tools": tools})


def response_format(body: dict) -> dict | None:
    """`text.format` as chat's `response_format`."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise errors.wrong_type("text", "an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise errors.wrong_type("text.format", "an object")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def output_items(service: Service, tools: ToolRequest, text: str) -> list[dict]:
    """The answer's text as a message item and its calls as function_call items."""
    if tools.parses:
        parsed = parse_calls(service.tool_format, text)
        text, calls = parsed.text, parsed.calls
    else:
        calls = []
    items = []
    if text or not calls:
        items.append(message_item(new_id("msg"), text, "completed"))
    for call in calls:
        items.append(call_item(new_id("fc"), new_id("call"), call.name, call.arguments, "completed"))
    return items


async def responses(service: Service, body: dict, exchange: Exchange):
    check(body)
    model = check_model(service, body)
    items = input_items(body)
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = service.responses.get(previous) if isinstance(previous, str) else None
        if stored is None:
            raise errors.unknown_response(str(previous))
        items = list(stored.items) + items
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise errors.wrong_type("instructions", "a string")
    messages = parse.messages({"messages": chat_messages(items, instructions)}, False)
    tools = tool_request(body, chat_tools(body))
    chat_like = {k: body[k] for k in SAMPLING if k in body}
    fmt = response_format(body)
    if fmt is not None:
        chat_like["response_format"] = fmt
    max_tokens = parse.integer(body, "max_output_tokens", None)
    common = parse.common(chat_like, max_tokens=max_tokens, logprobs=False, top_logprobs=0)
    stream = parse.boolean(body, "stream", False)
    deadline = exchange.deadline = trio.current_time() + service.request_timeout
    common = await structured.constrained(service, common, structured.wanted_of(chat_like, tools, service.tool_format),
                                          deadline)
    prompt, _ = await chat_prompt(service, messages, tools, {"add_generation_prompt": True}, [], max_tokens or 0, deadline)
    exchange.prompt_tokens = len(prompt)
    streams = await submit(service, prompt, common, deadline, "input")
    response_id, created = new_id("resp"), int(time.time())
    if stream:
        return events(service, body, streams, tools, items, response_id, model, created, deadline, exchange)
    (choice,) = await collect(streams, deadline, exchange.timing)
    exchange.completion_tokens = len(choice.tokens)
    output = output_items(service, tools, "".join(choice.text))
    store(service, body, response_id, items, output)
    cut = choice.finish_reason == "length"
    return response_object(body, response_id, model, created, output, "incomplete" if cut else "completed",
                           usage(len(prompt), len(choice.tokens), choice.cached_tokens),
                           "max_output_tokens" if cut else None)
