"""The prompt cache: KV of prompt prefixes kept as chains of full blocks, found again by exact tokens.

A trie whose nodes are blocks: a node's key is its block's exact 16 tokens (no hash can collide), its
path from the root the whole prefix. Every node holds one reference on its block in the pool, under the
owner `("cache", node id)`, and is charged `bytes_per_block` of the held bytes.

The rules (DESIGN.md, from the seed review):
- A job that will restore an entry pins it (the whole path) from admission until its restore reports;
  the report unpins only after the job has used the entry.
- Eviction is LRU over unpinned leaves, so jobs admitted together never evict each other's states.
- `keep` charges the held bytes before it appends; with nothing left to evict it fails and the charge is
  undone (the request goes on uncached).
- Removing a pinned node (a failed restore, `forget`, `clear`) makes it dead: lookups miss it at once, its
  bytes stay charged, and the last unpin frees it. `forget` removes the entry ending at its tokens and
  what extends it; a failed restore removes its whole chain, since which block failed is not known.

All methods are synchronous and run on the Trio thread, so each is atomic between checkpoints.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .blocks import BlockPool, IntegrityError


@dataclass(eq=False)
class Node:
    id: int
    parent: "Node | None"
    key: tuple[int, ...]
    block: int
    depth: int  # blocks from the root, this one included
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    pins: int = 0
    dead: bool = False
    used: int = 0  # LRU clock at the last lookup, keep or restore

    def path(self) -> Iterator["Node"]:
        node: Node | None = self
        while node is not None:
            yield node
            node = node.parent


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a lookup: the node ending it, its tokens and its blocks, root first."""

    node: Node | None
    tokens: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class CacheStats:
    entries: int
    dead: int
    pinned: int
    held_bytes: int
    budget_bytes: int
    hits: int
    misses: int
    hit_tokens: int
    evictions: int
    keeps: int
    failed_keeps: int


class PromptCache:
    """Chains of full blocks keyed by their exact tokens, within `budget_bytes` of held KV."""

    def __init__(self, pool: BlockPool, budget_bytes: int, bytes_per_block: int) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.budget_bytes = budget_bytes
        self.bytes_per_block = bytes_per_block
        self.held_bytes = 0
        self._root: dict[tuple[int, ...], Node] = {}
        self._alive: dict[int, Node] = {}
        self._dead: dict[int, Node] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self._counts = dict(hits=0, misses=0, hit_tokens=0, evictions=0, keeps=0, failed_keeps=0)

    # ---- finding ----

    def _blocks_of(self, tokens: Sequence[int]) -> Iterator[tuple[int, ...]]:
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            yield tuple(tokens[start : start + self.block_size])

    def _walk(self, tokens: Sequence[int]) -> list[Node]:
        path, level = [], self._root
        for key in self._blocks_of(tokens):
            node = level.get(key)
            if node is None:
                break
            path.append(node)
            level = node.children
        return path

    def lookup(self, tokens: Sequence[int], *, count: bool = True) -> Match:
        """The longest cached prefix of `tokens` in whole blocks (counted as a hit or a miss unless `count`
        is False: a job that may have to look again later is counted once, with `count_lookup`)."""
        path = self._walk(tokens)
        if not path:
            if count:
                self.count_lookup(Match(None, 0, ()))
            return Match(None, 0, ())
        tick = next(self._clock)
        for node in path:
            node.used = tick
        match = Match(path[-1], len(path) * self.block_size, tuple(n.block for n in path))
        if count:
            self.count_lookup(match)
        return match

    def count_lookup(self, match: Match) -> None:
        """Count one lookup's result as a hit (with its tokens) or a miss."""
        if match.node is None:
            self._counts["misses"] += 1
        else:
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += match.tokens

    # ---- pins ----

    def pin(self, node: Node) -> None:
        """A job will restore `node`: it and every node before it stay until `unpin`."""
        for n in node.path():
            n.pins += 1

    def unpin(self, node: Node) -> None:
        for n in node.path():
            if n.pins <= 0:
                raise IntegrityError(f"unpin of cache node {n.id}, which has no pin")
            n.pins -= 1
            if n.dead and n.pins == 0:
                self._free(n)

    def report(self, node: Node, ok: bool) -> None:
        """A restore of `node` is over (the job has taken its own references). A failed one removes the
        whole chain first (which of its blocks failed is not known), so that the unpin that follows frees
        what no other job still holds."""
        if not ok:
            *_, first = node.path()
            self.remove(first)
        self.unpin(node)

    # ---- keeping ----

    def keep(self, tokens: Sequence[int], blocks: Sequence[int]) -> bool:
        """Cache the full blocks of a prompt whose KV is in `blocks`; False (and nothing kept) when the new
        blocks do not fit even after evicting every unpinned leaf off this prefix's path."""
        keys = list(self._blocks_of(tokens))
        path = self._walk(tokens)
        fresh = keys[len(path) :]
        if not fresh:
            self._touch(path)
            return True
        charge = len(fresh) * self.bytes_per_block
        self.held_bytes += charge  # charged before anything is appended
        protected = {n.id for n in path}
        while self.held_bytes > self.budget_bytes:
            if not self._evict_one(protected):
                self.held_bytes -= charge  # nothing left to evict: the keep fails, its charge undone
                self._counts["failed_keeps"] += 1
                return False
        parent = path[-1] if path else None
        level = parent.children if parent else self._root
        for i, key in enumerate(fresh):
            depth = len(path) + i
            node = Node(next(self._ids), parent, key, blocks[depth], depth + 1)
            self.pool.fork(("cache", node.id), [node.block])
            level[key] = node
            self._alive[node.id] = node
            parent, level = node, node.children
        self._touch(list(path) + [parent])
        self._counts["keeps"] += 1
        return True

    def _touch(self, nodes: Sequence[Node]) -> None:
        tick = next(self._clock)
        for node in nodes:
            node.used = tick

    # ---- removing ----

    def _evict_one(self, protected: set[int] = frozenset()) -> bool:
        leaves = [n for n in self._alive.values() if not n.children and n.pins == 0 and n.id not in protected]
        if not leaves:
            return False
        self._detach(min(leaves, key=lambda n: (n.used, n.id)))
        self._counts["evictions"] += 1
        return True

    def reclaim(self, blocks: int) -> None:
        """Evict LRU leaves until the pool has `blocks` free blocks or nothing more can go (admission's need)."""
        while self.pool.free < blocks and self._evict_one():
            pass

    def remove(self, node: Node) -> None:
        """Take `node` and everything after it out of the trie: pinned ones die, the rest are freed."""
        if node.dead:
            return
        for n in list(self._subtree(node)):
            self._detach(n)

    def forget(self, tokens: Sequence[int]) -> bool:
        """Remove the entry that ends exactly at `tokens` (whole blocks); False when there is none."""
        path, full = self._walk(tokens), len(tokens) // self.block_size
        if full == 0 or len(path) != full:
            return False
        self.remove(path[-1])
        return True

    def clear(self) -> None:
        for node in list(self._root.values()):
            self.remove(node)

    def _subtree(self, node: Node) -> Iterator[Node]:
        for child in list(node.children.values()):
            yield from self._subtree(child)
        yield node

    def _detach(self, node: Node) -> None:
        siblings = node.parent.children if node.parent is not None else self._root
        siblings.pop(node.key, None)
        del self._alive[node.id]
        if node.pins > 0:
            node.dead = True  # lookups miss it now; the last unpin frees it
            self._dead[node.id] = node
        else:
            self._free(node)

    def _free(self, node: Node) -> None:
        self._dead.pop(node.id, None)
        self.pool.release(("cache", node.id))
        self.held_bytes -= self.bytes_per_block

    # ---- observation ----

    def statistics(self) -> CacheStats:
        c = self._counts
        return CacheStats(
            entries=len(self._alive), dead=len(self._dead), pinned=sum(1 for n in self._alive.values() if n.pins),
            held_bytes=self.held_bytes, budget_bytes=self.budget_bytes, hits=c["hits"], misses=c["misses"],
            hit_tokens=c["hit_tokens"], evictions=c["evictions"], keeps=c["keeps"], failed_keeps=c["failed_keeps"],
        )

    def check_integrity(self) -> None:
        """Raise IntegrityError unless nodes, pins, held bytes and the pool's references all agree."""
        reachable: dict[int, Node] = {}
        stack = list(self._root.values())
        while stack:
            node = stack.pop()
            reachable[node.id] = node
            stack.extend(node.children.values())
        if reachable.keys() != self._alive.keys():
            raise IntegrityError("the trie and the live nodes disagree")
        for node in self._alive.values():
            if node.dead or node.pins < 0 or any(node.pins < c.pins for c in node.children.values()):
                raise IntegrityError(f"cache node {node.id}: bad pins or state")
        for node in self._dead.values():
            if not node.dead or node.pins <= 0 or node.id in reachable:
                raise IntegrityError(f"dead cache node {node.id} is reachable or unpinned")
        everyone = {**self._alive, **self._dead}
        for node in everyone.values():
            if self.pool.held(("cache", node.id)) != [node.block]:
                raise IntegrityError(f"cache node {node.id} does not hold exactly its block {node.block}")
        cache_owners = {o for o in self.pool.owners() if isinstance(o, tuple) and o[0] == "cache"}
        if cache_owners != {("cache", i) for i in everyone}:
            raise IntegrityError("the pool has cache references no node accounts for")
        if self.held_bytes != len(everyone) * self.bytes_per_block:
            raise IntegrityError(f"held bytes {self.held_bytes} != {len(everyone)} blocks charged")
