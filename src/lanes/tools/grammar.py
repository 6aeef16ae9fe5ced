"""The grammar a tool choice holds the answer to, over the family's own call format (`formats`):

- `required`: one call (or several, with `parallel_tool_calls`) and nothing else;
- a named function: one call of it;
- `auto`: free text, and where the model opens a call (its trigger), the call held to a tool's schema.

A call is `{"name": NAME, "<args_key>": ARGS}` with its keys in that order, NAME one of the tools' and ARGS
held to that tool's `parameters` (JSON's options as `lanes.grammar.engine` sets them), so the streaming
parser reads the name and the arguments where they must be.
"""

from __future__ import annotations

import json
from typing import Any

from ..grammar.engine import json_rule, lark
from .formats import ToolFormat


def call_schema(fmt: ToolFormat, tools: list[dict]) -> dict[str, Any]:
    """Any one of `tools` called: its name, then arguments that its parameters' schema allows."""
    options = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": function["name"]}, fmt.args_key: parameters},
                        "required": ["name", fmt.args_key], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""


def tool_grammar(fmt: ToolFormat, tools: list[dict], choice: str | dict, parallel: bool, lenient: bool = False) -> str:
    """llguidance's grammar for `choice` ("required", "auto", or {"function": {"name"}}) over `tools`."""
    if isinstance(choice, dict):
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
        parallel = False
    body = f'{_literal(fmt.open)} {json_rule(call_schema(fmt, tools), lenient)} {_literal(fmt.close)}'
    many = f'call ({_literal(fmt.between)} call)*' if parallel else "call"
    if choice == "auto" and fmt.anywhere:
        # Text, and a call wherever the text reaches the trigger (a lazy lexeme ends at its first match).
        trigger, rest = fmt.open.strip(), fmt.open[len(fmt.open.rstrip()):]
        body = f'{_literal(rest)} {json_rule(call_schema(fmt, tools), lenient)} {_literal(fmt.close)}'
        calls = "(call_trig call)*" if parallel else "(call_trig call)?"
        source = (f"%llguidance {{}}\nstart: {calls} TEXT\nTEXT: /(.|\\n)*/\n"
                  f"call_trig[lazy]: TEXT {_literal(trigger)}\ncall: {body}\n")
    elif choice == "auto":
        # The answer is text, or opens with the calls (text cannot start with the call's "{").
        source = f"%llguidance {{}}\nstart: TEXT | calls\nTEXT: /([^{{](.|\\n)*)?/\ncalls: {many}\ncall: {body}\n"
    else:
        source = f"%llguidance {{}}\nstart: {many}\ncall: {body}\n"
    return lark(source)
