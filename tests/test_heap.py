"""The start-up heap is frozen: what exists then is out of the collector's full collections, what
requests allocate later is still collected."""

import gc
import weakref

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
