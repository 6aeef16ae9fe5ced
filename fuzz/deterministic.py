"""Reproducible Trio schedules: the one place that touches Trio's private scheduling switch.

Trio shuffles each batch of runnable tasks; with its deterministic flag on, the shuffle comes from a
module-level `random.Random`, which this seeds, so a seed fixes the whole interleaving.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import trio._core._run as trio_run


@contextmanager
def deterministic_schedule(seed: int) -> Iterator[None]:
    """Within this block, every `trio.run` interleaves its tasks the same way for the same seed."""
    saved_flag, saved_state = trio_run._ALLOW_DETERMINISTIC_SCHEDULING, trio_run._r.getstate()
    trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True
    trio_run._r.seed(seed)
    try:
        yield
    finally:
        trio_run._ALLOW_DETERMINISTIC_SCHEDULING = saved_flag
        trio_run._r.setstate(saved_state)
