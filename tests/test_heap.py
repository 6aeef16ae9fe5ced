"""The start-up heap is frozen: what exists then is out of the collector's full collections, what
requests allocate later is still collected; with the heap's retention bounded, a large block freed leaves
the process's resident memory."""

import ctypes
import ctypes.util
import gc
import os
import sys
import weakref

import pytest

from lanes.heap import bound_heap_retention, freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_the_start_up_heap_is_frozen_and_later_garbage_still_collected():
    kept = Node()
    kept_ref = weakref.ref(kept)
    try:
        assert freeze_startup_heap() > 0 and gc.get_freeze_count() > 0
        del kept
        gc.collect()
        assert kept_ref() is not None  # frozen at start-up: a full collection does not walk it
        later = Node()
        later_ref = weakref.ref(later)
        del later
        gc.collect()
        assert later_ref() is None  # made after start-up: collected as usual
    finally:
        gc.unfreeze()  # the rest of the test run keeps its usual collector
        gc.collect()
    assert kept_ref() is None


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"), reason="glibc's malloc")
def test_with_retention_bounded_a_freed_large_block_leaves_the_process_every_time():
    """glibc alone raises its mmap threshold to a freed block's size, so the same block's second life comes
    from the heap and stays resident after its free; with the threshold fixed it is unmapped each time."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    bound_heap_retention()
    size = 8 << 20
    for _ in range(3):
        before = resident_bytes()
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        assert resident_bytes() - before >= size * 0.9
        libc.free(block)
        assert resident_bytes() - before < size * 0.1
