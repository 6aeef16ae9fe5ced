"""The start-up heap kept out of the garbage collector's way.

A loaded server holds hundreds of thousands of long-lived Python objects (torch, the model's modules,
the captured graphs, the tokenizer, the HTTP stack): with the default model loaded on the CPU, 737,000,
which one full collection took 286 ms to walk. Python runs a full collection once enough objects have
survived into the oldest generation (a quarter as many again), so a long-running server meets one now
and then: a pause every stream feels. Freezing what exists once start-up is done leaves the collector
only what requests allocate (docs/DECISIONS.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now into the permanent generation; how many moved.

    Call it once start-up is over (the model loaded, graphs captured): what it moves is never collected,
    so garbage made of those objects later is kept (start-up state lives for the process anyway)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MAPPED_FROM = 256 << 10  # blocks of this many bytes or more are mapped and unmapped each


def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing): a load
    frees many small blocks (file headers, the tokenizer's build), which stay resident until trimmed."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def bound_heap_retention() -> None:
    """Fix glibc's mmap threshold at 256 KiB (elsewhere nothing). Left to itself glibc raises the threshold
    to the largest block freed, after which a pass's activations come from the heap, and the heap keeps
    the largest pass's peak resident for good (the default model on the CPU: 24 MB after one 8-stream
    burst, 6 MB with the threshold fixed; bench/cpu.py's memory table, same speed)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MAPPED_FROM)
