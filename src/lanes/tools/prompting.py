"""Tools, assistant tool calls and tool results into the prompt, in the family's format: what the chat
template renders itself it gets (arguments as objects, so `tojson` writes them once), what it drops is
written into the messages' text here.

What a template renders is found by rendering it: a probe tool, call and result, each with a marker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..text.chat import ChatTemplate, ChatTemplateError
from .formats import ToolFormat

MARK = "lanes_probe_7f3a"
PROBE_TOOLS = [{"type": "function", "function": {"name": f"{MARK}_tool", "description": "",
                                                  "parameters": {"type": "object", "properties": {}}}}]


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools: renders the tool list, assistants' `tool_calls`, `tool` messages."""

    tools: bool
    calls: bool
    results: bool

    @classmethod
    def probe(cls, template: ChatTemplate | None) -> TemplateTools:
        if template is None:
            return cls(False, False, False)
        user = {"role": "user", "content": "hi"}
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": f"{MARK}_call", "arguments": {}}}]}
        result = {"role": "tool", "tool_call_id": "call_1", "content": f"{MARK}_result"}
        return cls(MARK + "_tool" in _render(template, [user], PROBE_TOOLS),
                   MARK + "_call" in _render(template, [user, call], PROBE_TOOLS),
                   MARK + "_result" in _render(template, [user, call, result], PROBE_TOOLS))


def _render(template: ChatTemplate, messages: list[dict], tools: list[dict]) -> str:
    try:
        return template.render(messages, add_generation_prompt=True, tools=tools)
    except ChatTemplateError:
        return ""


def arguments_object(arguments: Any) -> Any:
    """OpenAI's arguments string as the object a template's `tojson` writes (kept as it is if not JSON)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def call_text(fmt: ToolFormat, calls: list[dict]) -> str:
    """An assistant's tool calls as the family writes them."""
    written = []
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments", "{}")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        written.append((str(function.get("name", "")), text))
    return fmt.write_all(written)


def tools_text(fmt: ToolFormat, tools: list[dict]) -> str:
    """The tool list and how to call one, for a template that does not render tools."""
    listed = "\n".join(json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools)
    example = fmt.write("function_name", '{"argument": "value"}')
    return (f"You can call these functions:\n{listed}\n\nTo call a function, answer with exactly this and "
            f"nothing else:\n{example}")


def prepare(messages: list[dict], tools: list[dict] | None, fmt: ToolFormat, renders: TemplateTools
            ) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools to render: calls' arguments as objects where the template writes them, the
    tool list, calls and results written into text where it drops them."""
    out = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if renders.calls:
                calls = [{**c, "function": {**c.get("function", {}),
                                            "arguments": arguments_object(c.get("function", {}).get("arguments"))}}
                         for c in calls]
                message = {**message, "tool_calls": calls}
            else:
                before = message.get("content") or ""
                message = {k: v for k, v in message.items() if k != "tool_calls"}
                message["content"] = (before + "\n" if before else "") + call_text(fmt, calls)
        elif role == "tool" and not renders.results:
            message = {"role": "user", "content": f"Result of the function call: {message.get('content') or ''}"}
        out.append(message)
    if not tools or renders.tools:
        return out, tools
    text = tools_text(fmt, tools)
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        return [{**out[0], "content": f"{out[0]['content']}\n\n{text}"}] + out[1:], None
    return [{"role": "system", "content": text}] + out, None
