"""Generated token ids to text, one token at a time, never splitting a character."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole UTF-8 character

# Prompt tokens kept before the first generated one, so its leading space decodes as it does in context.
PROMPT_WINDOW = 6


class IncrementalDetokenizer:
    """Text for a stream of generated token ids.

    `push(id)` returns the text that became final with that token: never half a UTF-8 character, so
    a character split over byte tokens (`<0xE4>`, or byte-level pieces) comes out whole with its last
    piece. `flush()` returns what is left at the end. Without prompt ids, everything pushed and flushed,
    joined, equals `decode(all_generated_ids)`. With prompt ids the window starts in the prompt, so the
    first token's leading space is the one it has after the prompt (SentencePiece drops it at a start).

    The technique is the well-known one: decode a short window twice, from `prefix` to `read` (text
    already given out) and from `prefix` to the end, and give out the difference unless it ends in U+FFFD.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_ids: Iterable[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids)[-PROMPT_WINDOW:]
        self._prefix = 0  # start of the window
        self._read = len(self._ids)  # end of what has been given out
        self._done: str | None = None  # the window's given-out text, decoded once until the window moves

    def push(self, token_id: int) -> str:
        """The text that `token_id` makes final ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        done = self._given()
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(done) or text.endswith(REPLACEMENT):
            return ""
        self._settle()
        return text[len(done) :]

    def flush(self) -> str:
        """Whatever is left, incomplete characters included (as U+FFFD, as `decode` gives them)."""
        done = self._given()
        text = self._decode(self._ids[self._prefix :])
        self._settle()
        return text[len(done) :]

    def _given(self) -> str:
        if self._done is None:
            self._done = self._decode(self._ids[self._prefix : self._read])
        return self._done

    def _settle(self) -> None:
        # Everything is given out: the next window starts where this one's new text began.
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        self._done = None


class ByteDetokenizer:
    """`IncrementalDetokenizer`'s exact output, for a tokenizer whose decode joins its ids' bytes and reads
    them as UTF-8 with U+FFFD for bad bytes (a byte-level BPE): from a table of each id's bytes, so a token
    costs no decode call. Ids past the table decode to nothing, as the tokenizer skips them.

    Both give out the text of the bytes not yet given out unless it ends in U+FFFD: the window's two decodes
    differ by exactly that text, since every point where text was given out ends a character. Only the
    prompt's window may not (its decode then ends in U+FFFD): it is decoded with what follows, as the
    window is, until text is first given out. Nothing is pushed after `flush`.
    """

    def __init__(self, pieces: Sequence[bytes], prompt_ids: Iterable[int] = ()) -> None:
        self._pieces = pieces
        self._held = b""  # bytes not given out: an unfinished character, or text that ends in U+FFFD
        window = b"".join(self._piece(i) for i in list(prompt_ids)[-PROMPT_WINDOW:])
        text = window.decode("utf-8", "replace")
        self._window = window if text.endswith(REPLACEMENT) else None  # kept until text is first given out
        self._done = len(text)  # characters of the window's decode, given out as the prompt's

    def push(self, token_id: int) -> str:
        """The text that `token_id` makes final ("" while a character is still incomplete)."""
        pieces = self._pieces
        held = self._held + pieces[token_id] if token_id < len(pieces) else self._held
        if self._window is not None:
            return self._first(held)
        if not held:
            return ""
        text = held.decode("utf-8", "replace")
        if text.endswith(REPLACEMENT):
            self._held = held
            return ""
        self._held = b""
        return text

    def flush(self) -> str:
        """Whatever is left, incomplete characters included (as U+FFFD, as `decode` gives them)."""
        if self._window is None:
            text = self._held.decode("utf-8", "replace")
        else:
            text = (self._window + self._held).decode("utf-8", "replace")[self._done :]
        self._window, self._held = None, b""
        return text

    def _first(self, held: bytes) -> str:
        text = (self._window + held).decode("utf-8", "replace")
        if len(text) <= self._done or text.endswith(REPLACEMENT):
            self._held = held
            return ""
        self._window, self._held = None, b""
        return text[self._done :]

    def _piece(self, token_id: int) -> bytes:
        return self._pieces[token_id] if token_id < len(self._pieces) else b""
