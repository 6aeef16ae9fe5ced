"""A stream-through parser of tool calls in a family's format: text in as it is generated, deltas out.

It holds back only what may be the start of a call's tag, emits a call's name once it is whole, and passes
the argument text through as it comes, tracking JSON strings and depth a character at a time: nothing is
parsed twice. A call's text is what the tool grammar holds it to (`grammar`): `{"name": NAME, "<args_key>":
ARGS}` with that key order and spelling; text that breaks it is handed on as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .formats import ToolFormat


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallOpened:
    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Delta = Text | CallOpened | Arguments


@dataclass
class Call:
    name: str
    arguments: str = ""


@dataclass
class Parsed:
    """A whole answer: its text and its calls (as `collect` joins the deltas)."""

    text: str = ""
    calls: list[Call] = field(default_factory=list)


class ToolCallParser:
    """`push(text)` and `finish()` give the deltas of the text so far, in order."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls = 0
        self._state = "start" if not fmt.anywhere else "text"
        self._held = ""  # text that may begin the trigger
        self._space = ""  # whitespace after a call: text only if more text follows
        self._want, self._at = "", 0  # a literal being matched, and how far
        self._after = ""  # the state once the literal is matched
        self._seen = ""  # the call's text since it opened (handed on as text if it breaks)
        self._name = ""
        self._depth, self._string, self._escape = 0, False, False

    def push(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        i = 0
        while i < len(text):
            state = self._state
            if state == "start":
                self._open_or_text(text[i], out)
                continue
            if state == "plain":
                out.append(Text(text[i:]))
                return out
            if state == "text":
                i = self._text(text, i, out)
            elif state == "literal":
                i = self._literal(text, i, out)
            elif state == "name":
                i = self._read_name(text, i, out)
            else:
                i = self._arguments(text, i, out)
        return out

    def finish(self) -> list[Delta]:
        """What is left: held text (whitespace after calls is dropped), or a cut call's text if it broke."""
        held, self._held = self._held, ""
        if self._state == "text" and held:
            out: list[Delta] = []
            self._emit_text(held, out)
            return out
        return []

    # ---- states ----

    def _open_or_text(self, char: str, out: list[Delta]) -> None:
        """A format whose calls open the answer: a call if the answer's first character is its '{'."""
        if char == "{":
            self._expect(self.fmt.head(), "name")
        else:
            self._state = "plain"

    def _text(self, text: str, i: int, out: list[Delta]) -> int:
        trigger = self.fmt.trigger
        pending = self._held + text[i:]
        found = pending.find(trigger)
        if found >= 0:
            self._emit_text(pending[:found], out)
            self._held = ""
            self._expect(self.fmt.head(), "name", len(trigger))
            self._seen = trigger
            return len(text) - (len(pending) - found - len(trigger))
        keep = next((k for k in range(min(len(trigger) - 1, len(pending)), 0, -1)
                     if trigger.startswith(pending[-k:])), 0)
        self._emit_text(pending[: len(pending) - keep], out)
        self._held = pending[len(pending) - keep:]
        return len(text)

    def _emit_text(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        if self.calls and text.isspace():  # whitespace between or after calls: held, dropped at the end
            self._space += text
            return
        out.append(Text(self._space + text))
        self._space = ""

    def _expect(self, literal: str, after: str, at: int = 0) -> None:
        self._state, self._want, self._at, self._after = "literal", literal, at, after
        if at >= len(literal):
            self._state = after

    def _literal(self, text: str, i: int, out: list[Delta]) -> int:
        want = self._want
        while i < len(text) and self._at < len(want):
            if text[i] != want[self._at]:
                return self._broken(text, i, out)
            self._seen += text[i]
            self._at += 1
            i += 1
        if self._at == len(want):
            self._enter(self._after)
        return i

    def _enter(self, state: str) -> None:
        if state == "name":
            self._state, self._name = "name", ""
        elif state == "arguments":
            self._state, self._depth, self._string, self._escape = "arguments", 0, False, False
        elif state == "between":  # a call is over: text again, or the next call in a format of one answer
            self._seen = ""
            if self.fmt.anywhere:
                self._state = "text"
            else:
                self._expect(self.fmt.between + self.fmt.head(), "name")
        else:
            self._state = state

    def _read_name(self, text: str, i: int, out: list[Delta]) -> int:
        start = i
        while i < len(text):
            char = text[i]
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._name += text[start:i]
                self._seen += text[start:i]
                try:
                    name = json.loads(f'"{self._name}"')
                except ValueError:
                    return self._broken(text, i, out)
                out.append(CallOpened(self.calls, name))
                self._expect(self.fmt.middle(), "arguments")
                return i
            i += 1
        self._name += text[start:]
        self._seen += text[start:]
        return i

    def _arguments(self, text: str, i: int, out: list[Delta]) -> int:
        start = i
        while i < len(text):
            char = text[i]
            if self._string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._string = False
            elif char == '"':
                self._string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                if self._depth == 0:  # the call's own closing brace: the arguments are whole
                    break
                self._depth -= 1
            i += 1
        if i > start:
            out.append(Arguments(self.calls, text[start:i]))
        if i < len(text):
            self.calls += 1
            self._expect(self.fmt.tail(), "between")
            self._seen = ""
        return i

    def _broken(self, text: str, i: int, out: list[Delta]) -> int:
        """Text that is no call after all: what was held of it, and all after, is text."""
        out.append(Text(self._seen + text[i:]))
        self._seen = ""
        self._state = "plain"
        return len(text)


def parse(fmt: ToolFormat, text: str) -> Parsed:
    """A whole answer's text and calls: the deltas of one push, joined."""
    parser = ToolCallParser(fmt)
    return joined(parser.push(text) + parser.finish())


def joined(deltas: list[Delta]) -> Parsed:
    parsed = Parsed()
    texts = []
    for delta in deltas:
        if isinstance(delta, Text):
            texts.append(delta.text)
        elif isinstance(delta, CallOpened):
            parsed.calls.append(Call(delta.name))
        else:
            parsed.calls[delta.index].arguments += delta.text
    parsed.text = "".join(texts)
    return parsed
