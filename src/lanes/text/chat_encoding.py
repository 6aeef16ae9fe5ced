"""A chat's ids with no control token forged from client text: what transformers' `apply_chat_template(...,
sanitize_control_tokens=True)` gives.

Control tokens (special tokens, and the added tokens the template writes) found in client strings are
wrapped in two private-use markers before rendering; after it, the text is split at the markers and each
marked token is encoded as plain text, while the rest, the template's own markup included, is encoded
as usual. A chat whose client strings hold no control token is encoded exactly as its rendered text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import tokenizers

from .chat import ChatTemplateError

LONG_TEXT = 16 << 10  # characters past which a text is encoded as a batch of one, which frees the GIL meanwhile
MARKERS = ("\U000f0000", "\U000f0001")  # transformers' markers, kept unless a client string holds one
FIRST_MARKER, LAST_MARKER = 0xF0000, 0x10FFFD  # the supplementary private-use planes 15 and 16
PRIVATE_USE = re.compile("[\U000f0000-\U0010fffd]")


def control_tokens(added: Mapping[int, tokenizers.AddedToken], template_text: str,
                   listed: Iterable[str] | None) -> list[str]:
    """transformers' control tokens: every special token, and the added tokens the tokenizer config lists
    (`chat_control_tokens`) or else those in the template's literal text, whitespace tokens aside."""
    if listed is not None:
        chosen = set(listed)
        return [t.content for t in added.values() if t.special or t.content in chosen]
    return [t.content for t in added.values() if t.special or (t.content in template_text and not t.content.isspace())]


def alternation(texts: Iterable[str]) -> str:
    """A pattern matching any of `texts`, longest first (a token wins over the tokens inside it); never
    matching when there are none."""
    return "|".join(map(re.escape, sorted(set(texts), key=len, reverse=True))) or "(?!)"


class ChatEncoder:
    """Marks control tokens in client strings and encodes a chat rendered from them.

    Promises: `encode(render(mark(x)))` equals transformers' sanitized ids for x; with no control token in
    x's strings, `mark` changes nothing and `encode` is the plain encoding of the rendered text.
    """

    def __init__(self, backend: tokenizers.Tokenizer, control: Iterable[str], template_source: str = "") -> None:
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self._ids_of = {token.content: index for index, token in added.items()}
        self._control = re.compile(alternation(control))
        self._tokens = alternation(self._ids_of)  # a marked piece is any added token, as transformers splits
        self._template_private = frozenset(PRIVATE_USE.findall(template_source))
        self._newline = backend.encode("\n", add_special_tokens=False).ids
        self._default_split = self._splitter(MARKERS)

    def markers(self, *values: Any) -> tuple[str, str]:
        """transformers' markers, or where a client string (or the template) holds one, the first two
        private-use characters that none holds."""
        taken = set(self._template_private)
        for text in _strings(values):
            if PRIVATE_USE.search(text):
                taken.update(PRIVATE_USE.findall(text))
        if not taken.intersection(MARKERS):
            return MARKERS
        free = (chr(c) for c in range(FIRST_MARKER, LAST_MARKER + 1) if chr(c) not in taken)
        return next(free), next(free)

    def mark(self, value: Any, markers: tuple[str, str]) -> Any:
        """`value` with every control token in its strings wrapped in the markers (dict keys are left, as
        transformers leaves them)."""
        if isinstance(value, str):
            return self._control.sub(f"{markers[0]}\\g<0>{markers[1]}", value)
        if isinstance(value, Mapping):
            return {key: self.mark(item, markers) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(item, markers) for item in value]
        return value

    def encode(self, text: str, markers: tuple[str, str]) -> list[int]:
        """The ids of a chat rendered from marked values: marked tokens as plain text, the rest as usual.
        Raises ChatTemplateError for a control token that the tokenizer also makes from its plain text."""
        start, end = markers
        if start not in text and end not in text:
            return encode_ids(self._backend, text, False)
        split = self._default_split if markers == MARKERS else self._splitter(markers)
        # [text, marked token, text, ...]; a lone marker (a template's string method split a pair) gives None
        pieces = split.split(text)
        ids = encode_ids(self._backend, pieces[0], False)
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = i % 2 == 1
            piece_ids = self._piece(piece, as_text)
            if as_text and self._ids_of[piece] in piece_ids:
                raise ChatTemplateError(f"the control token {piece!r} in a message cannot be encoded as text")
            ids += piece_ids
        return ids

    def _splitter(self, markers: tuple[str, str]) -> re.Pattern:
        start, end = map(re.escape, markers)
        return re.compile(f"{start}({self._tokens}){end}|[{start}{end}]")

    def _piece(self, piece: str, as_text: bool) -> list[int]:
        """A piece from inside the chat, encoded after a newline that is then taken off (so SentencePiece
        adds no word start as at the start of a text), or alone where the newline merges with it."""
        encode = self._plain if as_text else (lambda t: self._backend.encode(t, add_special_tokens=False).ids)
        ids = encode("\n" + piece)
        if ids[: len(self._newline)] == self._newline:
            return ids[len(self._newline) :]
        return encode(piece)

    def _plain(self, text: str) -> list[int]:
        """`text` through the normalizer, the pre-tokenizer and the model, matching no added token."""
        backend = self._backend
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = [text] if backend.pre_tokenizer is None else [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for split in splits if split for token in backend.model.tokenize(split)]


def _strings(value: Any) -> Iterable[str]:
    """Every string in a JSON-like value, dict keys included, without recursion on the interpreter's stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def encode_ids(backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`backend.encode(text).ids`; a long text through `encode_batch`, the same ids, which lets other threads run
    meanwhile (`encode` holds the GIL: a 100k-token prompt in a worker thread would stall the event loop)."""
    if len(text) < LONG_TEXT:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
