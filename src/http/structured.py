"""What a request holds its answer to: `response_format` (json_object, json_schema), vLLM's
`structured_outputs` and `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and tool
choices (`tool_calls.ToolRequest`), as one grammar checked by the engine before the request is submitted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import trio

from ..core.grammar import Grammar
from ..core.sampling import InvalidParameter
from ..grammar import engine as grammars
from . import errors

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar",
                   "json_object": None}


@dataclass(frozen=True)
class Wanted:
    """A grammar asked for, not yet checked: its llguidance source builder's input and where it came from."""

    kind: str  # json_schema, regex, choice, lark
    value: Any
    param: str
    lenient: bool = False  # a json_schema given with strict false: keywords the engine cannot enforce are skipped
    optional: bool = False  # `tool_choice: auto`: without a grammar engine the model is left free, not refused


def response_format(body: dict) -> Wanted | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise errors.wrong_type("response_format", "an object with a 'type'")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Wanted("json_schema", {"type": "object"}, "response_format")
    if kind != "json_schema":
        raise errors.out_of_range("response_format.type", "'response_format.type' must be text, json_object or json_schema")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise errors.missing("response_format.json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise errors.wrong_type("response_format.json_schema.schema", "a JSON schema object")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise errors.wrong_type("response_format.json_schema.strict", "a boolean")
    return Wanted("json_schema", schema, "response_format.json_schema.schema", lenient=strict is False)


def guided(body: dict) -> list[Wanted]:
    """vLLM's extras: the `guided_*` fields, and `structured_outputs` with the same keys less the prefix."""
    found = []
    for name in GUIDED:
        if body.get(name) is not None:
            found.append(_guided(name, body[name], name))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise errors.wrong_type("structured_outputs", "an object")
        for key, value in outputs.items():
            if key not in STRUCTURED_KEYS:
                raise errors.unsupported(f"structured_outputs.{key}")
            if value is None or value is False:
                continue
            if key == "json_object":
                found.append(Wanted("json_schema", {"type": "object"}, "structured_outputs.json_object"))
            else:
                found.append(_guided(STRUCTURED_KEYS[key], value, f"structured_outputs.{key}"))
    return found


def _guided(name: str, value: Any, param: str) -> Wanted:
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise errors.wrong_type(param, "a JSON schema") from None
        if not isinstance(value, (dict, bool)):
            raise errors.wrong_type(param, "a JSON schema")
        return Wanted("json_schema", value, param)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise errors.wrong_type(param, "a non-empty list of non-empty strings")
        return Wanted("choice", value, param)
    if not isinstance(value, str) or not value:
        raise errors.wrong_type(param, "a non-empty string")
    return Wanted("regex" if name == "guided_regex" else "lark", value, param)


def only_one(wanted: list[Wanted]) -> Wanted | None:
    if len(wanted) > 1:
        raise errors.conflicting_constraints(wanted[1].param, wanted[0].param)
    return wanted[0] if wanted else None


def source(wanted: Wanted) -> str:
    if wanted.kind == "json_schema":
        return grammars.json_schema(wanted.value, wanted.lenient)
    if wanted.kind == "regex":
        return grammars.regex(wanted.value)
    if wanted.kind == "choice":
        return grammars.choice(wanted.value)
    if wanted.kind == "lark":
        return grammars.lark(wanted.value)
    return wanted.value  # a tool grammar, built already


async def checked(engine: grammars.GrammarEngine | None, wanted: Wanted, deadline: float) -> Grammar:
    """The grammar, compiled by the engine in a worker thread; a 400 naming the keyword it cannot enforce."""
    if engine is None:
        raise errors.unsupported(wanted.param)
    with trio.move_on_at(deadline):
        try:
            return await trio.to_thread.run_sync(lambda: engine.check(source(wanted), wanted.kind))
        except grammars.GrammarRefused as refused:
            if refused.keyword is not None and wanted.kind in ("json_schema", "tools"):
                raise errors.schema_keyword(wanted.param, refused.keyword, refused.message) from None
            raise errors.invalid_grammar(wanted.param, refused.message) from None
        except ValueError as error:  # the schema or grammar itself is not one llguidance reads
            raise errors.invalid_grammar(wanted.param, " ".join(str(error).split())) from None
    raise errors.deadline_exceeded()


def wanted_of(body: dict, tools=None, fmt=None) -> Wanted | None:
    """The one grammar the request asks for (its response format, a guided field, or its tool choice)."""
    wanted = only_one([w for w in [response_format(body), *guided(body)] if w])
    if tools is None:
        return wanted
    if wanted is not None and tools.parses:
        raise errors.conflicting_constraints(wanted.param, "tools")
    return wanted or tools.wanted(fmt)


async def constrained(service, common, wanted: Wanted | None, deadline: float):
    """`common` with the grammar its answer is held to, checked by the engine (a 400 if it cannot be held)."""
    if wanted is None or (wanted.optional and service.grammars is None):
        return common
    grammar = await checked(service.grammars, wanted, deadline)
    sampling = dataclasses.replace(common.sampling, grammar=grammar)
    try:
        sampling.validate()
    except InvalidParameter as error:
        raise errors.out_of_range(error.param, error.message) from None
    return dataclasses.replace(common, sampling=sampling)
