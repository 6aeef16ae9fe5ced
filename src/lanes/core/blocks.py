"""The KV block pool's bookkeeping: which blocks are free, who holds each one, and how many times.

The pool is one object on the Trio thread with synchronous methods, so each call is atomic between
checkpoints. The lane core allocates and releases its lanes' blocks; the prompt cache forks (takes extra
references on) chains it keeps. The device memory behind the ids lives in `lanes.gpu.kv`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Iterable

BLOCK_SIZE = 16


class PoolExhausted(Exception):
    """Raised by `allocate` when fewer blocks are free than asked for; nothing was taken."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"the KV block pool has {free} free blocks, {wanted} were asked for")
        self.wanted = wanted
        self.free = free


class IntegrityError(AssertionError):
    """Broken accounting: a bug, never a user error."""


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """How many blocks hold `tokens` tokens."""
    return -(-tokens // block_size)


@dataclass(frozen=True)
class PoolStats:
    total: int
    free: int
    used: int  # blocks with at least one reference
    shared: int  # blocks with more than one reference
    held_by: dict[str, int]  # references per kind of owner (the first item of an owner key, or its repr)


@dataclass
class BlockPool:
    """Reference-counted blocks of `block_size` tokens; owners are hashable keys such as `("lane", 3)`.

    Invariants (checked by `check_integrity`): every block is either free with no reference or used with
    as many references as owners hold it; free + used == total.
    """

    total: int
    block_size: int = BLOCK_SIZE
    _free: list[int] = field(init=False, repr=False)
    _refs: list[int] = field(init=False, repr=False)
    _owners: dict[Hashable, Counter[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise ValueError("a block pool needs at least one block")
        # Popped from the end, so low ids go first: exact ids are predictable in tests.
        self._free = list(range(self.total - 1, -1, -1))
        self._refs = [0] * self.total
        self._owners = {}

    @property
    def free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: Hashable, n: int) -> list[int]:
        """Take `n` free blocks for `owner` (one reference each), or raise PoolExhausted taking none."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > len(self._free):
            raise PoolExhausted(n, len(self._free))
        taken = [self._free.pop() for _ in range(n)]
        held = self._owners.setdefault(owner, Counter())
        for block in taken:
            self._refs[block] = 1
            held[block] += 1
        return taken

    def fork(self, owner: Hashable, blocks: Iterable[int]) -> None:
        """`owner` takes one more reference on each of `blocks`, which must be in use."""
        blocks = list(blocks)
        for block in blocks:
            if not 0 <= block < self.total or self._refs[block] == 0:
                raise IntegrityError(f"fork of block {block}, which is not in use")
        held = self._owners.setdefault(owner, Counter())
        for block in blocks:
            self._refs[block] += 1
            held[block] += 1

    def release(self, owner: Hashable, blocks: Iterable[int] | None = None) -> None:
        """Drop `owner`'s references (on `blocks`, or all of them); a block with none left is free."""
        held = self._owners.get(owner)
        if held is None:
            if blocks is None:
                return  # releasing an owner twice is allowed (idempotent teardown)
            raise IntegrityError(f"{owner!r} holds no blocks")
        for block in list(held.elements()) if blocks is None else list(blocks):
            if held[block] == 0:
                raise IntegrityError(f"{owner!r} releases block {block}, which it does not hold")
            held[block] -= 1
            if held[block] == 0:
                del held[block]
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        if not held:
            del self._owners[owner]

    def held(self, owner: Hashable) -> list[int]:
        """The blocks `owner` holds, in ascending id order, one entry per reference."""
        return sorted(self._owners.get(owner, Counter()).elements())

    def refs(self, block: int) -> int:
        return self._refs[block]

    def owners(self) -> list[Hashable]:
        return list(self._owners)

    def statistics(self) -> PoolStats:
        held_by: Counter[str] = Counter()
        for owner, held in self._owners.items():
            kind = owner[0] if isinstance(owner, tuple) and owner else owner
            held_by[str(kind)] += sum(held.values())
        used = sum(1 for r in self._refs if r > 0)
        return PoolStats(
            total=self.total,
            free=len(self._free),
            used=used,
            shared=sum(1 for r in self._refs if r > 1),
            held_by=dict(held_by),
        )

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every reference is accounted for and free + used == total."""
        if len(set(self._free)) != len(self._free):
            raise IntegrityError("a block is on the free list twice")
        counted: Counter[int] = Counter()
        for owner, held in self._owners.items():
            if not held or any(n <= 0 for n in held.values()):
                raise IntegrityError(f"{owner!r} is listed with no references")
            counted.update(held)
        for block in range(self.total):
            if counted[block] != self._refs[block]:
                raise IntegrityError(f"block {block} has {self._refs[block]} references, owners hold {counted[block]}")
        free = set(self._free)
        for block in range(self.total):
            if (block in free) != (self._refs[block] == 0):
                raise IntegrityError(f"block {block} is {'free' if block in free else 'used'} with {self._refs[block]} references")
        if len(free) + sum(1 for r in self._refs if r > 0) != self.total:
            raise IntegrityError("free + used != total")


@dataclass
class BlockTable:
    """One lane's blocks in position order and how many tokens they hold (owned by the lane core)."""

    owner: Hashable
    blocks: list[int] = field(default_factory=list)
    tokens: int = 0

    def blocks_to_grow(self, new_tokens: int, block_size: int = BLOCK_SIZE) -> int:
        """How many more blocks holding `new_tokens` more tokens needs."""
        return max(0, blocks_for(self.tokens + new_tokens, block_size) - len(self.blocks))

    def grow(self, pool: BlockPool, new_tokens: int) -> None:
        """Make room for `new_tokens` more tokens (raises PoolExhausted, taking nothing, when it can't)."""
        self.blocks += pool.allocate(self.owner, self.blocks_to_grow(new_tokens, pool.block_size))
        self.tokens += new_tokens

    def reserve(self, pool: BlockPool, capacity: int) -> None:
        """Hold enough blocks for `capacity` tokens (raises PoolExhausted, taking nothing, when it can't)."""
        self.blocks += pool.allocate(self.owner, max(0, blocks_for(capacity, pool.block_size) - len(self.blocks)))

    def adopt(self, pool: BlockPool, blocks: Iterable[int], tokens: int) -> None:
        """Start from shared blocks holding `tokens` tokens (a restored prefix): forked, not copied."""
        if self.blocks:
            raise IntegrityError("adopt on a table that already holds blocks")
        blocks = list(blocks)
        if tokens != len(blocks) * pool.block_size:
            raise IntegrityError("only full blocks are shared: a lane writes into its last block")
        pool.fork(self.owner, blocks)
        self.blocks = blocks
        self.tokens = tokens

    def clear(self, pool: BlockPool) -> None:
        pool.release(self.owner)
        self.blocks = []
        self.tokens = 0
