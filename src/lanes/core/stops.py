"""Stop strings over streamed text: text that may begin one is held back, and none of a stop string is emitted."""

from __future__ import annotations

from collections.abc import Sequence

from ..text.detok import ByteDetokenizer, IncrementalDetokenizer


class StopStrings:
    """One stream's stop strings, matched on the concatenated text however it is split into deltas.

    The stream stops at the first point where some stop string is complete (the earliest end; of those
    ending there, the longest); what is emitted is everything before that match (with `include`, up to
    its end), whatever the splits. Text that could still be the start of a stop string is held back until
    it is ruled out, so emitted text is never retracted and never holds any part of a match it excludes.
    Text pushed while not `armed` (the stream's first min_tokens tokens) can start a match but never end
    one, as vLLM checks only text after them. After the stop, `push` and `flush` give "".
    """

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        if not all(stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._include = include
        self._held = ""
        self._unarmed = 0  # leading characters of the held text pushed while not armed
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def held(self) -> str:
        """Text received but not yet emitted, because a stop string may start in it."""
        return self._held

    def push(self, delta: str, armed: bool = True) -> tuple[str, bool]:
        """(text now safe to emit, whether a stop string was completed)."""
        if self._stopped:
            return "", True
        text = self._held + delta
        match = self._first_match(text, self._unarmed) if armed else None
        if match is not None:
            self._held, self._stopped = "", True
            return text[: match[1] if self._include else match[0]], True
        keep = self._longest_open_prefix(text)
        emitted = len(text) - keep
        self._held = text[emitted:]
        self._unarmed = max(0, self._unarmed - emitted) if armed else keep
        return text[:emitted], False

    def flush(self) -> str:
        """The held-back text, for a stream that ends for another reason (length, EOS, abort)."""
        text, self._held = self._held, ""
        return "" if self._stopped else text

    def _first_match(self, text: str, skip: int) -> tuple[int, int] | None:
        """(start, end) of the match that completes first in `text` after its first `skip` characters
        (ties: the longest), or None."""
        best: tuple[int, int] | None = None  # (end, -length)
        for stop in self._stops:
            start = text.find(stop, max(0, skip - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), -len(stop)) < best):
                best = (start + len(stop), -len(stop))
        return None if best is None else (best[0] + best[1], best[0])

    def _longest_open_prefix(self, text: str) -> int:
        """The length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class TextAssembler:
    """One stream's text from its token ids: whole characters (IncrementalDetokenizer), cut at stop strings.

    `push(id)` gives the text that became final and safe with that token and whether a stop string was
    completed; `finish()` gives the rest when the stream ends for another reason. Together they give the
    stream's decoded text, cut before the first stop string to complete (after it, with `include_stop`)
    in the text of its tokens past the first `min_tokens`.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer | ByteDetokenizer, stops: Sequence[str], *,
                 min_tokens: int = 0, include_stop: bool = False) -> None:
        self._detokenizer = detokenizer
        # Without stop strings the text passes straight on.
        self._stops = StopStrings(stops, include_stop) if stops else None
        self._min_tokens = min_tokens
        self._pushed = 0

    @property
    def stopped(self) -> bool:
        return self._stops is not None and self._stops.stopped

    def push(self, token_id: int) -> tuple[str, bool]:
        if self._stops is None:
            return self._detokenizer.push(token_id), False
        if self._stops.stopped:
            return "", True
        self._pushed += 1
        return self._stops.push(self._detokenizer.push(token_id), self._pushed > self._min_tokens)

    def finish(self) -> str:
        """The rest of the text: incomplete characters as U+FFFD, held-back text, still cut at a stop string."""
        if self._stops is None:
            return self._detokenizer.flush()
        if self._stops.stopped:
            return ""
        text, stopped = self._stops.push(self._detokenizer.flush(), self._pushed > self._min_tokens)
        return text if stopped else text + self._stops.flush()
