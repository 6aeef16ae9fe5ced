"""A chat request's tools: `tool_choice` and `parallel_tool_calls` checked, the grammar a choice holds the
answer to, and the answer's calls in OpenAI's shapes (a message's `tool_calls`, streamed deltas by `index`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from ..tools import grammar as tool_grammar
from ..tools.formats import ToolFormat
from ..tools.parser import Arguments, CallOpened, Delta, Parsed, Text, ToolCallParser
from . import errors
from .structured import Wanted


@dataclass(frozen=True)
class ToolRequest:
    """The tools offered (None with `tool_choice: none`), the choice ("auto", "required" or a named
    function) and whether several calls may come."""

    tools: list[dict] | None
    choice: str | dict
    parallel: bool

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls."""
        return self.tools is not None

    def wanted(self, fmt: ToolFormat) -> Wanted | None:
        """The grammar of the choice over the family's format (lenient where no tool is strict)."""
        if self.tools is None:
            return None
        lenient = not any(t["function"].get("strict") for t in self.tools)
        source = tool_grammar.tool_grammar(fmt, self.tools, self.choice, self.parallel, lenient)
        return Wanted("tools", source, "tools", optional=self.choice == "auto")


def tool_request(body: dict, tools: list[dict] | None) -> ToolRequest:
    """`tool_choice` and `parallel_tool_calls` against the request's (checked) tools."""
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise errors.wrong_type("parallel_tool_calls", "a boolean")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise errors.out_of_range("tool_choice", "'tool_choice' must be none, auto, required or a named function")
    elif isinstance(choice, dict):
        function = choice.get("function") if choice.get("type", "function") == "function" else None
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if not isinstance(name, str):
            raise errors.wrong_type("tool_choice", "none, auto, required or {'type': 'function', 'function': {'name'}}")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise errors.unknown_tool("tool_choice", name) if tools else errors.tool_choice_without_tools()
        choice = {"type": "function", "function": {"name": name}}
    else:
        raise errors.wrong_type("tool_choice", "none, auto, required or {'type': 'function', 'function': {'name'}}")
    if choice == "required" and not tools:
        raise errors.tool_choice_without_tools()
    if choice == "none" or not tools:
        return ToolRequest(None, "none", parallel)
    return ToolRequest(tools, choice, parallel)


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def message_calls(parsed: Parsed, ids: list[str]) -> list[dict[str, Any]]:
    """A message's `tool_calls` from the parsed answer, with the ids its stream gave them."""
    return [{"id": ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(parsed.calls)]


def delta_of(delta: Delta, ids: list[str]) -> dict[str, Any]:
    """A chat chunk's `delta` for one parser delta (a call's first delta names it; ids are made there)."""
    if isinstance(delta, Text):
        return {"content": delta.text}
    if isinstance(delta, CallOpened):
        ids.append(call_id())
        return {"tool_calls": [{"index": delta.index, "id": ids[delta.index], "type": "function",
                                "function": {"name": delta.name, "arguments": ""}}]}
    assert isinstance(delta, Arguments)
    return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.text}}]}


def new_parser(fmt: ToolFormat, request: ToolRequest) -> ToolCallParser | None:
    return ToolCallParser(fmt) if request.parses else None
