"""The stream-through tool-call parser: every family's format, cut into random pieces, gives the same text
and calls as the whole answer parsed at once, and those are the calls that were written.

Rules: answers are written with `ToolFormat.write_all` from random calls (names, nested arguments, strings
with quotes, escapes, braces, tags and non-ASCII text) and random text around them; 1,000 seeded runs.
"""

import json
import random

import pytest

from lanes.tools.formats import HERMES, JSON, LLAMA3_JSON, choose
from lanes.tools.parser import Arguments, CallOpened, Text, ToolCallParser, joined, parse

FORMATS = [HERMES, LLAMA3_JSON, JSON]
NASTY = ['say "hi"', "a\\b", "{not json}", "</tool_call>", "<tool_call>", "line\nbreak", "é ü 漢字", "}", "]]", ""]


def value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(NASTY) + str(rng.randrange(100))
    if kind == 1:
        return rng.randrange(-1000, 1000) / rng.choice([1, 10])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.choice(NASTY)
    if kind == 4:
        return [value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {f"k{i}{rng.choice(NASTY)}": value(rng, depth + 1) for i in range(rng.randrange(3))}


def answer(rng: random.Random, fmt):
    calls = [(rng.choice(["get_weather", "add", "lookup_user"]),
              json.dumps({f"a{i}": value(rng) for i in range(rng.randrange(4))}, ensure_ascii=rng.random() < 0.5))
             for _ in range(rng.randrange(1, 4))]
    before = rng.choice(["", "Let me check. ", "<tool", "text with <tool_ inside\n"]) if fmt.anywhere else ""
    return before, calls, before + fmt.write_all(calls)


def pieces(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 30))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("seed", range(1000))
def test_streamed_pieces_give_the_calls_written_and_equal_the_whole(seed):
    rng = random.Random(seed)
    fmt = FORMATS[seed % 3]
    before, calls, text = answer(rng, fmt)
    parser = ToolCallParser(fmt)
    deltas = [d for piece in pieces(rng, text) for d in parser.push(piece)] + parser.finish()
    streamed, whole = joined(deltas), parse(fmt, text)
    assert streamed == whole
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    assert whole.text == before
    opened = [d for d in deltas if isinstance(d, CallOpened)]
    assert [d.index for d in opened] == list(range(len(calls)))  # each name once, when whole
    assert all(isinstance(d, (Text, CallOpened, Arguments)) for d in deltas)


def test_text_alone_streams_through_and_a_partial_tag_is_held_only_while_it_may_be_one():
    parser = ToolCallParser(HERMES)
    assert parser.push("Hello <tool") == [Text("Hello ")]
    assert parser.push("kit>") == [Text("<toolkit>")]
    assert parser.push(" bye") == [Text(" bye")]
    assert parser.finish() == []
    assert parse(LLAMA3_JSON, "Paris is the capital.").text == "Paris is the capital."
    assert parse(JSON, "{broken").text == "{broken" and parse(JSON, "{broken").calls == []


def test_the_format_is_chosen_from_the_template():
    assert choose("{{ '<tool_call>\\n' }}") is HERMES
    assert choose('{{ \'"parameters": \' }} Environment: ipython') is LLAMA3_JSON
    assert choose("{{ message['content'] }}") is JSON and choose(None) is JSON
