"""The start-up heap kept out of the garbage collector's way.

A loaded server holds a few hundred thousand long-lived Python objects (torch, the model's modules, the
captured graphs, the tokenizer). Python's full collections walk every one of them, and passes allocate
enough to trigger one every few seconds of decoding: a pause of tens of milliseconds on the event loop,
which every stream feels (bench/gpu.py's 64-stream runs fell from ~39,000 to 15,000-25,000 tok/s when
one landed in them). Freezing what exists once start-up is done leaves the collector only what requests
allocate.
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
