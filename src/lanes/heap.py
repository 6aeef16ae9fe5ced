"""The start-up heap kept out of the garbage collector's way.

A loaded server holds hundreds of thousands of long-lived Python objects (torch, the model's modules,
the captured graphs, the tokenizer, the HTTP stack): with the default model loaded on the CPU, 737,000,
which one full collection took 286 ms to walk. Python runs a full collection once enough objects have
survived into the oldest generation (a quarter as many again), so a long-running server meets one now
and then: a pause every stream feels. Freezing what exists once start-up is done leaves the collector
only what requests allocate (docs/DECISIONS.md).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now into the permanent generation; how many moved.

    Call it once start-up is over (the model loaded, graphs captured): what it moves is never collected,
    so garbage made of those objects later is kept (start-up state lives for the process anyway)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
