"""The start-up heap is frozen: what exists then is out of the collector's full collections, what
requests allocate later is still collected; with the heap's retention bounded, a large block freed leaves
the process's resident memory."""

import ctypes
import ctypes.util
import gc
import subprocess
import sys
import weakref

import pytest

from lanes.heap import freeze_startup_heap


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


CHILD = """
import ctypes, ctypes.util, os
from lanes.heap import bound_heap_retention

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if {bound}:
    bound_heap_retention()
size = 8 << 20
for _ in range(3):
    before = resident()
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    grown = resident() - before
    libc.free(block)
    print(grown // 2**20, (resident() - before) // 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"), reason="glibc's malloc")
def test_with_retention_bounded_a_freed_large_block_leaves_the_process_every_time():
    """glibc alone raises its mmap threshold to a freed block's size, so the same block's second life comes
    from the heap and stays resident after its free; with the threshold fixed it is unmapped each time.
    Each case in a process of its own: a process's earlier frees leave chunks a block may reuse."""
    def run(bound: bool) -> list[tuple[int, int]]:
        out = subprocess.run([sys.executable, "-c", CHILD.format(bound=bound)], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return [tuple(int(n) for n in line.split()) for line in out.splitlines()]

    assert run(True) == [(8, 0), (8, 0), (8, 0)]  # MB resident with the block, and after its free
    assert run(False)[1][1] >= 7  # glibc's own policy: the second block stays resident after its free
