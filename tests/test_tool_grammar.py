"""The grammar of a tool choice, held against token sequences written by hand (llguidance over a tiny
byte-level tokenizer): `auto` lets text through and, once the text reaches the family's trigger, holds
the call to a tool's name and its parameters' schema; `required` and a named function allow only calls.

Rules: no model runs; `validate` says how many tokens the grammar takes in turn, so a refusal is seen at
the token where it happens. The schemas are the tests' own; llguidance's compile is the reference.
"""

import json

import pytest

import tiny
from lanes.grammar.engine import GrammarEngine
from lanes.text.tokenizer import Tokenizer
from lanes.tools.formats import HERMES, LLAMA3_JSON
from lanes.tools.grammar import tool_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tools_engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    vocab = tiny.write_tokenizer(folder) + 6
    tokenizer = Tokenizer.from_folder(folder, vocab)
    return tokenizer, GrammarEngine.for_tokenizer(tokenizer, vocab, tokenizer.eos_ids)


def taken(tools_engine, fmt, choice, text: str, parallel: bool = False) -> tuple[int, int]:
    """(tokens of `text` the grammar takes, tokens in `text`)."""
    tokenizer, engine = tools_engine
    matcher = engine.matcher(engine.check(tool_grammar(fmt, [WEATHER, TIME], choice, parallel), "tools"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate(ids), len(ids)


def call(name: str, args: dict, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: args}, separators=(", ", ": "))


def whole(result: tuple[int, int]) -> bool:
    return result[0] == result[1]


def test_auto_lets_text_through_then_holds_an_opened_call_to_the_schema(tools_engine):
    text = "Let me look that up. "
    opened = text + "<tool_call>\n"
    assert whole(taken(tools_engine, HERMES, "auto", text))
    assert whole(taken(tools_engine, HERMES, "auto", opened + call("get_weather", {"city": "Paris"}) + "\n</tool_call>"))
    assert whole(taken(tools_engine, HERMES, "auto", opened + '{"name": "get_'))
    assert not whole(taken(tools_engine, HERMES, "auto", opened + '{"name": "get_stock'))  # no such tool
    assert whole(taken(tools_engine, HERMES, "auto", opened + '{"name": "get_weather", "arguments": {"'))
    assert not whole(taken(tools_engine, HERMES, "auto", opened + '{"name": "get_weather", "arguments": {"town'))
    assert not whole(taken(tools_engine, HERMES, "auto", opened + '{"name": "get_weather", "arguments": {}}'))  # city


def test_auto_without_a_trigger_is_text_or_calls_from_the_start(tools_engine):
    assert whole(taken(tools_engine, LLAMA3_JSON, "auto", "It is sunny."))
    assert whole(taken(tools_engine, LLAMA3_JSON, "auto", call("get_time", {}, "parameters")))
    assert not whole(taken(tools_engine, LLAMA3_JSON, "auto", '{"name": "get_weather", "parameters": {}}'))


def test_required_and_named_choices_allow_only_calls(tools_engine):
    assert taken(tools_engine, HERMES, "required", "Sure")[0] == 0
    named = {"type": "function", "function": {"name": "get_time"}}
    assert not whole(taken(tools_engine, HERMES, named, "<tool_call>\n" + call("get_weather", {"city": "Oslo"})))
    assert whole(taken(tools_engine, HERMES, named, "<tool_call>\n" + call("get_time", {}) + "\n</tool_call>"))
