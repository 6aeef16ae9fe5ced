"""Stop strings over streamed text, and the per-stream text assembler.

Rules: the reference is the text cut by hand: scan the whole text left to right, stop at the first
position where some stop string ends (the longest of those ending there), keep what comes before it.
Every way of splitting the text into deltas must give that same text, and along the way what has been
emitted is a prefix of it that holds no stop string (nothing is ever retracted). The assembler is
checked with a tiny byte-level BPE tokenizer built here, where every non-ASCII character spans tokens.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import write_tokenizer

from lanes.core.stops import StopStrings, TextAssembler
from lanes.text.detok import REPLACEMENT
from lanes.text.tokenizer import Tokenizer


def cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the first stop string to complete, and whether one did."""
    for end in range(1, len(text) + 1):
        ending = [stop for stop in stops if text[:end].endswith(stop)]
        if ending:
            return text[: end - max(map(len, ending))], True
    return text, False


def splits(text: str):
    """Every way to cut `text` into non-empty deltas."""
    for mask in range(1 << max(len(text) - 1, 0)):
        points = [0] + [i + 1 for i in range(len(text) - 1) if mask >> i & 1] + [len(text)]
        yield [text[a:b] for a, b in itertools.pairwise(points)]


def stream(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    """Feeds `deltas`, checking the invariants after each push; returns (all emitted text, stopped)."""
    expected, will_stop = cut("".join(deltas), stops)
    matcher = StopStrings(stops)
    emitted, received = "", ""
    for delta in deltas:
        received += delta
        text, stopped = matcher.push(delta)
        emitted += text
        assert expected.startswith(emitted)
        assert not any(stop in emitted for stop in stops)
        if stopped:
            assert matcher.push("more") == ("", True)
            assert matcher.flush() == ""
            return emitted, True
        assert emitted + matcher.held == received
        assert len(matcher.held) < max(map(len, stops), default=1)
    assert not will_stop
    return emitted + matcher.flush(), False


CASES = [
    ("hello world", ["o w", "wor", "ld"]),
    ("abababcab", ["abc", "bab"]),  # overlapping: "bab" completes first
    ("xabcab", ["abc", "ab"]),  # one a prefix of the other: "ab" completes first
    ("abcdefg", ["abcdef", "cd"]),  # the longer one starts earlier but completes later
    ("xxabcdyy", ["bcd", "abcd", "cd"]),  # three end together: cut before the longest
    ("aaaaab", ["aaab", "aab"]),
    ("abcabdab", ["abd!", "abdx"]),  # never completes: everything comes out, some only at flush
    ("tail abc", ["abcd"]),  # the text ends inside a stop string
    ("日本語のテキスト", ["語の", "キスト", "のテ"]),
    ("no stops here", []),
    ("short", ["a much longer stop"]),
]


@pytest.mark.parametrize(("text", "stops"), CASES)
def test_every_split_gives_the_text_cut_at_the_first_stop(text, stops):
    expected = cut(text, stops)
    for deltas in splits(text):
        assert stream(stops, deltas) == expected, deltas
        with_empty = [piece for delta in deltas for piece in ("", delta)] + [""]
        assert stream(stops, with_empty) == expected, deltas


def test_reference_cuts():
    # The rule written as results, so the reference itself is pinned.
    assert [cut(text, stops) for text, stops in CASES[:6]] == [
        ("hell", True), ("a", True), ("x", True), ("ab", True), ("xx", True), ("aa", True),
    ]


def test_held_text_is_released_as_soon_as_it_is_ruled_out():
    matcher = StopStrings(["</tool>", "STOP"])
    assert matcher.push("call </to") == ("call ", False)
    assert matcher.held == "</to"
    assert matcher.push("x> S") == ("</tox> ", False)
    assert matcher.push("T") == ("", False)
    assert matcher.push("OP and more") == ("", True)
    assert matcher.stopped


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        StopStrings(["a", ""])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abé ", max_size=16),
    stops=st.lists(st.text(alphabet="abé ", min_size=1, max_size=4), max_size=4),
    points=st.lists(st.integers(min_value=0, max_value=16), max_size=8),
)
def test_random_texts_stops_and_splits(text, stops, points):
    bounds = sorted({0, len(text), *(p for p in points if p <= len(text))})
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert stream(stops, deltas) == cut(text, stops)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tokenizer")
    return Tokenizer.from_folder(folder, write_tokenizer(folder))


ASSEMBLED = [
    ("the wörld is 日本 there", ["本 t"]),  # across a 3-byte character's tokens and a merge
    ("the wörld is 日本 there", ["日"]),  # a stop string that is one character split over three tokens
    ("the wörld is 日本 there", ["ö", "is"]),
    ("in the 🤗 hub", ["🤗 h", "zz"]),
    ("in the 🤗 hub", ["then"]),  # never completes
]


@pytest.mark.parametrize(("text", "stops"), ASSEMBLED)
def test_assembler_cuts_decoded_text_at_stops(tokenizer, text, stops):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())
    expected, will_stop = cut(tokenizer.decode(ids), stops)
    assembler = TextAssembler(tokenizer.detokenizer(), stops)
    pieces, stopped = [], False
    for token in ids:
        piece, stopped = assembler.push(token)
        assert REPLACEMENT not in piece
        pieces.append(piece)
        if stopped:
            break
    assert stopped == will_stop
    if stopped:
        assert assembler.push(ids[0]) == ("", True)
        assert assembler.finish() == ""
    else:
        pieces.append(assembler.finish())
    assert "".join(pieces) == expected


def test_assembler_after_a_prompt_and_at_a_cut_character(tokenizer):
    prompt = tokenizer.encode("say:", add_special_tokens=False)
    ids = tokenizer.encode(" ok 日", add_special_tokens=False)
    assembler = TextAssembler(tokenizer.detokenizer(prompt), ["ko"])
    pieces = [assembler.push(token) for token in ids[:-1]]  # the last byte of 日 never arrives
    assert all(not stopped for _, stopped in pieces)
    assert "".join(text for text, _ in pieces) + assembler.finish() == " ok " + REPLACEMENT


def cut_after(text: str, stops: list[str], armed_from: int, include: bool) -> tuple[str, bool]:
    """vLLM's cut: the first stop string to complete past the first `armed_from` characters (the text of
    the first min_tokens tokens, never checked), cut before it or, with `include`, after it."""
    for end in range(armed_from + 1, len(text) + 1):
        ending = [stop for stop in stops if text[:end].endswith(stop)]
        if ending:
            return (text[:end] if include else text[: end - max(map(len, ending))]), True
    return text, False


@pytest.mark.parametrize(("text", "stops"), [("abababcab", ["abc", "bab"]), ("xabcab", ["abc", "ab"]),
                                             ("aaaaab", ["aaab", "aab"]), ("xxabcdyy", ["bcd", "abcd", "cd"])])
@pytest.mark.parametrize("include", [False, True])
def test_text_of_the_first_tokens_never_ends_a_match_and_include_keeps_it(text, stops, include):
    for deltas in splits(text):
        for unarmed in range(len(deltas) + 1):
            expected, will_stop = cut_after(text, stops, len("".join(deltas[:unarmed])), include)
            matcher, emitted, stopped = StopStrings(stops, include), "", False
            for i, delta in enumerate(deltas):
                piece, stopped = matcher.push(delta, armed=i >= unarmed)
                emitted += piece
                assert expected.startswith(emitted), (deltas, unarmed)
                if stopped:
                    break
            assert stopped == will_stop
            assert (emitted if stopped else emitted + matcher.flush()) == expected, (deltas, unarmed)


def test_the_assembler_holds_stops_off_for_min_tokens_as_vllm(tokenizer):
    # vLLM's own case (tests/detokenizer/test_min_tokens.py), on this tokenizer's tokens: the stop "e" in
    # the text of the first tokens (through " I", five tokens of OPT's) is passed over.
    ids = tokenizer.encode(" is Lee, and I'm a student in the college of engineering", add_special_tokens=False)
    pieces = [tokenizer.decode([token]) for token in ids]
    through_i = next(m for m in range(len(ids)) if "".join(pieces[:m]) == " is Lee, and I")
    for min_tokens in (0, 3, through_i):
        assembler = TextAssembler(tokenizer.detokenizer(), ["e"], min_tokens=min_tokens)
        out = ""
        for token in ids:
            text, stopped = assembler.push(token)
            out += text
            if stopped:
                break
        assert out == cut_after("".join(pieces), ["e"], len("".join(pieces[:min_tokens])), False)[0]
    assert out == " is Lee, and I'm a stud"  # vLLM's answer
    assembler = TextAssembler(tokenizer.detokenizer(), ["ll"], include_stop=True)
    text = "".join(assembler.push(token)[0] for token in ids)
    assert text == " is Lee, and I'm a student in the coll"
