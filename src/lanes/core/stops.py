"""Stop strings over streamed text: text that may begin one is held back, and none of a stop string is emitted."""

from __future__ import annotations

from collections.abc import Sequence

from ..text.detok import ByteDetokenizer, IncrementalDetokenizer


class StopStrings:
    """One stream's stop strings, matched on the concatenated text however it is split into deltas.

    The stream stops at the first point where some stop string is complete (the earliest end; of those
    ending there, the longest); what is emitted is everything before that match, whatever the splits.
    Text that could still be the start of a stop string is held back until it is ruled out, so emitted
    text is never retracted and never holds any part of a match. After the stop, `push` and `flush`
    give "".
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if not all(stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def held(self) -> str:
        """Text received but not yet emitted, because a stop string may start in it."""
        return self._held

    def push(self, delta: str) -> tuple[str, bool]:
        """(text now safe to emit, whether a stop string was completed)."""
        if self._stopped:
            return "", True
        text = self._held + delta
        cut = self._first_match(text)
        if cut is not None:
            self._held, self._stopped = "", True
            return text[:cut], True
        keep = self._longest_open_prefix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, for a stream that ends for another reason (length, EOS, abort)."""
        text, self._held = self._held, ""
        return "" if self._stopped else text

    def _first_match(self, text: str) -> int | None:
        """Where the match that completes first in `text` starts (ties: the longest), or None."""
        best: tuple[int, int] | None = None  # (end, -length)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), -len(stop)) < best):
                best = (start + len(stop), -len(stop))
        return None if best is None else best[0] + best[1]

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
    stream's decoded text, cut before the first stop string to complete.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer | ByteDetokenizer, stops: Sequence[str]) -> None:
        self._detokenizer = detokenizer
        self._stops = StopStrings(stops) if stops else None  # without stop strings the text passes straight on

    @property
    def stopped(self) -> bool:
        return self._stops is not None and self._stops.stopped

    def push(self, token_id: int) -> tuple[str, bool]:
        if self._stops is None:
            return self._detokenizer.push(token_id), False
        if self._stops.stopped:
            return "", True
        return self._stops.push(self._detokenizer.push(token_id))

    def finish(self) -> str:
        """The rest of the text: incomplete characters as U+FFFD, held-back text, still cut at a stop string."""
        if self._stops is None:
            return self._detokenizer.flush()
        if self._stops.stopped:
            return ""
        text, stopped = self._stops.push(self._detokenizer.flush())
        return text if stopped else text + self._stops.flush()
