"""Progress lines for long work (loading, conversions, benchmarks) on stderr."""

from __future__ import annotations

import sys
import time


class Progress:
    """Counts steps toward `total`; on a terminal it redraws one line, elsewhere it prints every 25%."""

    def __init__(self, label: str, total: int, *, stream=None, unit: str = "") -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.started = time.monotonic()
        self._quarter = -1

    def advance(self, steps: int = 1) -> None:
        self.done = min(self.total, self.done + steps)
        if self.tty:
            self._draw("\r")
        elif (quarter := 4 * self.done // self.total) > self._quarter:
            self._quarter = quarter
            self._draw("")
            self.stream.write("\n")

    def close(self) -> None:
        if self.tty:
            self._draw("\r")
            self.stream.write("\n")
        self.stream.flush()

    def _draw(self, prefix: str) -> None:
        width = 24
        filled = width * self.done // self.total
        bar = "#" * filled + "." * (width - filled)
        seconds = time.monotonic() - self.started
        unit = f" {self.unit}" if self.unit else ""
        self.stream.write(f"{prefix}{self.label} [{bar}] {self.done}/{self.total}{unit} {seconds:.1f}s")
        self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
