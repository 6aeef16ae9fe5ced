"""The prompt cache at its own interface: pins, dead entries, held bytes, LRU eviction, failed keeps.

Rules: pure host-side tests over a real BlockPool; exact node states, pins, held bytes and pool references
after every step; `check_integrity()` on both the cache and the pool after every test. The two seed
regressions would fail on a cache that frees an entry when it is removed: they assert the block is still
referenced (and charged) until the last unpin.
"""

import pytest

from lanes.core.prompt_cache import PromptCache
from lanes.core.blocks import BlockPool, IntegrityError

BS = 16
BPB = 100  # bytes a block, for round numbers


def tokens(blocks: int, first: int = 0) -> tuple[int, ...]:
    return tuple(range(first, first + blocks * BS))


def lane_with(pool: BlockPool, owner, blocks: int) -> list[int]:
    """A lane's blocks holding a prompt's KV (what a prompt pass leaves behind)."""
    return pool.allocate(owner, blocks)


@pytest.fixture
def pool():
    pool = BlockPool(32)
    yield pool
    pool.check_integrity()


def test_keep_then_lookup_finds_the_longest_prefix_in_whole_blocks(pool):
    cache = PromptCache(pool, budget_bytes=10 * BPB, bytes_per_block=BPB)
    blocks = lane_with(pool, "lane", 3)
    assert cache.keep(tokens(3) + (999,) * 5, blocks)  # the partial last block is not kept
    assert cache.held_bytes == 3 * BPB
    assert [pool.refs(b) for b in blocks] == [2, 2, 2]
    match = cache.lookup(tokens(2) + (7, 7))
    assert (match.tokens, match.blocks) == (32, tuple(blocks[:2]))
    assert cache.lookup(tokens(3)).tokens == 48
    assert cache.lookup((1,) + tokens(3)[1:]).node is None  # one token off in the first block: a miss
    assert cache.lookup(tokens(3)[:15]).node is None  # not even one whole block
    stats = cache.statistics()
    assert (stats.entries, stats.hits, stats.misses, stats.hit_tokens) == (3, 2, 2, 80)
    pool.release("lane")
    cache.check_integrity()


def test_two_jobs_pin_one_entry_and_the_first_restore_fails(pool):
    cache = PromptCache(pool, budget_bytes=10 * BPB, bytes_per_block=BPB)
    blocks = lane_with(pool, "lane", 2)
    cache.keep(tokens(2), blocks)
    pool.release("lane")
    first, second = cache.lookup(tokens(2)), cache.lookup(tokens(2))
    cache.pin(first.node)
    cache.pin(second.node)
    cache.report(first.node, ok=False)  # the first restore failed: the entry is removed
    assert cache.lookup(tokens(2)).node is None  # lookups miss it at once
    assert [pool.refs(b) for b in blocks] == [1, 1]  # alive: the second borrow still holds it
    assert cache.held_bytes == 2 * BPB  # and still charged
    assert (second.node.dead, second.node.pins) == (True, 1)
    assert cache.statistics().dead == 2
    cache.check_integrity()
    cache.report(second.node, ok=True)  # the second job's unpin frees it
    assert [pool.refs(b) for b in blocks] == [0, 0]
    assert cache.held_bytes == 0 and cache.statistics().dead == 0
    cache.check_integrity()


def test_forget_on_a_pinned_entry_keeps_it_alive_until_its_unpin(pool):
    cache = PromptCache(pool, budget_bytes=10 * BPB, bytes_per_block=BPB)
    blocks = lane_with(pool, "lane", 2)
    cache.keep(tokens(2), blocks)
    pool.release("lane")
    job = cache.lookup(tokens(2))
    cache.pin(job.node)
    assert cache.forget(tokens(2))
    assert cache.lookup(tokens(2)).tokens == 16  # the first block is still an entry of its own
    assert pool.refs(blocks[1]) == 1 and cache.held_bytes == 2 * BPB  # the forgotten block lives, charged
    cache.check_integrity()
    cache.unpin(job.node)
    assert pool.refs(blocks[1]) == 0 and cache.held_bytes == BPB
    assert not cache.forget(tokens(2))  # already gone
    cache.check_integrity()


def test_lru_eviction_order_and_held_bytes_after_every_step(pool):
    cache = PromptCache(pool, budget_bytes=4 * BPB, bytes_per_block=BPB)
    a, b, c = (lane_with(pool, name, 2) for name in "abc")
    assert cache.keep(tokens(2, 0), a) and cache.held_bytes == 2 * BPB
    assert cache.keep(tokens(2, 1000), b) and cache.held_bytes == 4 * BPB
    cache.lookup(tokens(2, 0))  # a is now more recent than b
    assert cache.keep(tokens(2, 2000), c)  # evicts b's two blocks, leaf first
    assert cache.held_bytes == 4 * BPB and cache.statistics().evictions == 2
    assert cache.lookup(tokens(2, 1000)).node is None
    assert cache.lookup(tokens(2, 0)).tokens == 32 and cache.lookup(tokens(2, 2000)).tokens == 32
    for name in "abc":
        pool.release(name)
    assert [pool.refs(x) for x in b] == [0, 0]
    cache.check_integrity()


def test_a_shared_prefix_is_kept_once_and_branches_evict_leaf_first(pool):
    cache = PromptCache(pool, budget_bytes=4 * BPB, bytes_per_block=BPB)
    system = tokens(2)
    first, second = lane_with(pool, "q1", 3), lane_with(pool, "q2", 3)
    assert cache.keep(system + tokens(1, 500), first)
    assert cache.keep(system + tokens(1, 600), second)  # only its third block is new
    assert cache.held_bytes == 4 * BPB and cache.statistics().entries == 4
    assert pool.refs(second[0]) == 1  # the second lane's copy of the system prompt is not kept twice
    third = lane_with(pool, "q3", 3)
    assert cache.keep(system + tokens(1, 700), third)  # evicts the least recent branch leaf, not the trunk
    assert cache.lookup(system).tokens == 32
    assert cache.lookup(system + tokens(1, 500)).tokens == 32  # the oldest branch went
    assert cache.lookup(system + tokens(1, 700)).tokens == 48
    for name in ("q1", "q2", "q3"):
        pool.release(name)
    cache.check_integrity()


def test_jobs_admitted_together_never_evict_each_others_entries(pool):
    big = BlockPool(64)
    cache = PromptCache(big, budget_bytes=16 * BPB, bytes_per_block=BPB)
    matches = []
    for i in range(16):
        blocks = lane_with(big, ("lane", i), 1)
        assert cache.keep(tokens(1, 100 * i), blocks)
        big.release(("lane", i))
    for i in range(16):  # sixteen jobs admitted in one pass, each pinning its own entry
        match = cache.lookup(tokens(1, 100 * i))
        cache.pin(match.node)
        matches.append(match)
    newcomer = lane_with(big, "new", 1)
    assert not cache.keep(tokens(1, 5000), newcomer)  # everything is pinned: the keep fails
    assert cache.held_bytes == 16 * BPB and cache.statistics().failed_keeps == 1  # its charge undone
    assert all(cache.lookup(tokens(1, 100 * i)).tokens == 16 for i in range(16))
    for match in matches:
        cache.report(match.node, ok=True)
    assert cache.keep(tokens(1, 5000), newcomer)  # now one unpinned leaf can go
    assert cache.statistics().evictions == 1
    big.release("new")
    cache.check_integrity()
    big.check_integrity()


def test_reclaim_frees_blocks_for_admission_and_clear_removes_everything(pool):
    cache = PromptCache(pool, budget_bytes=100 * BPB, bytes_per_block=BPB)
    for i in range(4):
        blocks = lane_with(pool, ("lane", i), 4)
        cache.keep(tokens(4, 1000 * i), blocks)
        pool.release(("lane", i))
    assert pool.free == 32 - 16
    pinned = cache.lookup(tokens(4, 0))
    cache.pin(pinned.node)
    cache.reclaim(30)  # wants 30 free: everything unpinned goes
    assert pool.free == 28 and cache.lookup(tokens(4, 0)).tokens == 64
    cache.clear()
    assert cache.statistics().entries == 0 and cache.statistics().dead == 4
    assert cache.held_bytes == 4 * BPB
    cache.unpin(pinned.node)
    assert pool.free == 32 and cache.held_bytes == 0
    cache.check_integrity()


def test_integrity_catches_an_unpin_without_a_pin_and_a_stray_reference(pool):
    cache = PromptCache(pool, budget_bytes=10 * BPB, bytes_per_block=BPB)
    blocks = lane_with(pool, "lane", 1)
    cache.keep(tokens(1), blocks)
    node = cache.lookup(tokens(1)).node
    with pytest.raises(IntegrityError):
        cache.unpin(node)
    pool.fork(("cache", 999), blocks)  # a planted reference no node accounts for
    with pytest.raises(IntegrityError, match="cache references no node accounts for"):
        cache.check_integrity()
    pool.release(("cache", 999))
    pool.release("lane")
    cache.check_integrity()
