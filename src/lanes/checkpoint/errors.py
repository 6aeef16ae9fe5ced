"""The one error a checkpoint that cannot be loaded ends in."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded; `str()` is one line naming the file and the fault."""

    def __init__(self, path: Path | str, fault: str) -> None:
        super().__init__(f"{path}: {fault}")
        self.path = Path(path)
        self.fault = fault
