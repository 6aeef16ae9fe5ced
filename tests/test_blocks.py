"""The KV block pool's bookkeeping: exact block ids, reference counts and accounting after every step.

Rules: pure host-side tests, no torch; every test ends with `check_integrity()`.
"""

import pytest

from lanes.core.blocks import BlockPool, BlockTable, IntegrityError, PoolExhausted, blocks_for


def test_allocate_takes_low_ids_first_and_release_returns_them():
    pool = BlockPool(8)
    assert pool.allocate(("lane", 0), 3) == [0, 1, 2]
    assert pool.allocate(("lane", 1), 2) == [3, 4]
    assert pool.free == 3
    pool.release(("lane", 0))
    assert pool.free == 6
    assert pool.held(("lane", 0)) == []
    assert pool.held(("lane", 1)) == [3, 4]
    stats = pool.statistics()
    assert (stats.total, stats.free, stats.used, stats.shared) == (8, 6, 2, 0)
    assert stats.held_by == {"lane": 2}
    pool.check_integrity()


def test_fork_counts_references_and_the_last_release_frees():
    pool = BlockPool(4)
    blocks = pool.allocate(("lane", 0), 2)
    pool.fork(("cache", "e1"), blocks)
    pool.fork(("lane", 1), blocks[:1])
    assert [pool.refs(b) for b in range(4)] == [3, 2, 0, 0]
    assert pool.statistics().shared == 2
    assert pool.statistics().held_by == {"lane": 3, "cache": 2}
    pool.release(("lane", 0))
    assert [pool.refs(b) for b in range(4)] == [2, 1, 0, 0]
    assert pool.free == 2
    pool.release(("cache", "e1"))
    assert [pool.refs(b) for b in range(4)] == [1, 0, 0, 0]
    assert pool.free == 3
    pool.release(("lane", 1))
    assert pool.free == 4
    pool.check_integrity()


def test_exhaustion_raises_a_typed_error_and_takes_nothing():
    pool = BlockPool(3)
    pool.allocate("a", 2)
    with pytest.raises(PoolExhausted) as caught:
        pool.allocate("b", 2)
    assert (caught.value.wanted, caught.value.free) == (2, 1)
    assert pool.free == 1
    assert pool.held("b") == []
    pool.check_integrity()


def test_release_of_a_block_not_held_and_fork_of_a_free_block_are_integrity_errors():
    pool = BlockPool(3)
    pool.allocate("a", 1)
    with pytest.raises(IntegrityError):
        pool.release("a", [2])
    with pytest.raises(IntegrityError):
        pool.fork("b", [1])
    pool.release("a")
    pool.release("a")  # idempotent
    pool.check_integrity()


def test_check_integrity_catches_a_corrupted_count():
    pool = BlockPool(3)
    pool.allocate("a", 1)
    pool._refs[0] = 2  # a planted accounting bug
    with pytest.raises(IntegrityError, match="block 0 has 2 references, owners hold 1"):
        pool.check_integrity()


def test_block_table_grows_by_whole_blocks_and_adopts_shared_full_blocks():
    pool = BlockPool(10)
    assert blocks_for(0) == 0 and blocks_for(16) == 1 and blocks_for(17) == 2
    first = BlockTable(("lane", 0))
    first.grow(pool, 20)
    assert (first.blocks, first.tokens) == ([0, 1], 20)
    first.grow(pool, 12)
    assert (first.blocks, first.tokens) == ([0, 1], 32)
    first.grow(pool, 1)
    assert (first.blocks, first.tokens) == ([0, 1, 2], 33)
    second = BlockTable(("lane", 1))
    second.adopt(pool, first.blocks[:2], 32)
    second.grow(pool, 5)
    assert second.blocks == [0, 1, 3]
    assert [pool.refs(b) for b in range(4)] == [2, 2, 1, 1]
    with pytest.raises(IntegrityError):
        BlockTable(("lane", 2)).adopt(pool, [0], 10)  # a partly filled block is never shared
    with pytest.raises(PoolExhausted):
        second.grow(pool, 16 * 7)
    assert (second.blocks, second.tokens) == ([0, 1, 3], 37)
    first.clear(pool)
    second.clear(pool)
    assert pool.free == 10
    pool.check_integrity()
