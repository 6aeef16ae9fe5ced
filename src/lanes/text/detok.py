"""Generated token ids to text, one token at a time, never splitting a character."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import accumulate

import tokenizers
from tokenizers import decoders

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


class PieceTable(Sequence[bytes]):
    """Each id's bytes, all in one buffer: a tuple of 49,152 bytes objects holds some 2 MB, this a third of
    that (ints only as indices)."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self._blob = b"".join(pieces)
        self._ends = array("I", accumulate((len(piece) for piece in pieces), initial=0))

    def __len__(self) -> int:
        return len(self._ends) - 1

    def __getitem__(self, token_id: int) -> bytes:  # type: ignore[override]
        ends = self._ends
        if not 0 <= token_id < len(ends) - 1:
            raise IndexError(f"no piece for id {token_id}")
        return self._blob[ends[token_id] : ends[token_id + 1]]


def byte_pieces(backend: tokenizers.Tokenizer, vocab: Mapping[str, int], special_ids: frozenset[int]) -> PieceTable | None:
    """Each id's bytes, when `decode` (special tokens skipped) is the UTF-8 reading of its ids' bytes joined:
    the ByteLevel decoder's (its characters mapped back to bytes, a token with another character taken as its
    own UTF-8). None for any other decoder, or if one id decodes otherwise (every id is checked)."""
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    pieces = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, index in vocab.items():
        if index not in special_ids:
            pieces[index] = _token_bytes(token)
    decoded = backend.decode_batch([[index] for index in range(len(pieces))], skip_special_tokens=True)
    if decoded != [piece.decode("utf-8", "replace") for piece in pieces]:
        return None
    return PieceTable(pieces)


def with_special_pieces(backend: tokenizers.Tokenizer, vocab: Mapping[str, int], pieces: PieceTable | None,
                         special_ids: frozenset[int]) -> PieceTable | None:
    """`pieces` with the special ids' bytes too (`decode` with skip_special_tokens=False joins them as it
    joins the others), each checked as `byte_pieces` checks; None where there is no table or one differs."""
    if pieces is None:
        return None
    table = list(pieces)
    for token, index in vocab.items():
        if index in special_ids:
            table[index] = _token_bytes(token)
    ids = sorted(special_ids)
    decoded = backend.decode_batch([[index] for index in ids], skip_special_tokens=False)
    if decoded != [table[index].decode("utf-8", "replace") for index in ids]:
        return None
    return PieceTable(table)


def _token_bytes(token: str) -> bytes:
    """A byte-level token's bytes: each character's byte, or the token's own UTF-8 where one is outside the alphabet."""
    try:
        return token.translate(_LATIN1_BYTES).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode()


def _latin1_bytes() -> dict[int, int]:
    """GPT-2's byte alphabet backwards, for `str.translate`: each character ByteLevel shows to the Latin-1
    character of its byte, and the other characters below U+0100 to one that Latin-1 cannot encode."""
    shown = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    hidden = [byte for byte in range(256) if byte not in shown]  # shown as U+0100, U+0101, ... in order
    return {**{byte: 0x10000 for byte in hidden}, **{byte: byte for byte in shown},
            **{256 + i: byte for i, byte in enumerate(hidden)}}


_LATIN1_BYTES = _latin1_bytes()
