"""Decode passes as CUDA graphs: one graph a batch-size bucket, captured once at start-up, replayed a pass.

Each graph runs the decoder's fast decode step (`Decoder.decode_step`: Triton kernels, paged attention
reading block tables on the device) on static input buffers. A pass packs its lanes' token ids,
positions, slots, lengths, feed rows and block tables into one host buffer, copies it to the device in
one transfer, and replays the smallest bucket that holds it; padding rows write only the scratch block.
Every graph leaves its greedy draws in one device buffer, where a row with a feed row reads its token
(a `fed` plan: the pass is queued before the host has seen the draws of the one before it).
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
import torch

from ..core.passes import Piece
from ..core.sampling import greedy_draw
from .transfer import PinnedRing
from ..progress import Progress

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class DecodeGraphs:
    """Captured decode steps for every bucket up to `max_lanes` lanes (on the decoder's device)."""

    def __init__(self, decoder, max_lanes: int, max_model_len: int) -> None:
        self.decoder = decoder
        kv = decoder.kv
        self.block_size = kv.shape.block_size
        self.width = -(-max_model_len // self.block_size)  # blocks in a table row
        self.buckets = [b for b in BUCKETS if b < max_lanes] + [max_lanes]
        self.max_lanes = max_lanes
        n = max_lanes
        # tokens, positions, slots, lengths, feed rows: [5, n]; then tables: [n, width] (int64, one transfer).
        # On CUDA staged in page-locked buffers taken in turn: the copy of a pass queued behind the running
        # one may not have run when the next pass is packed (three: two passes in flight at most).
        total = 5 * n + n * self.width
        staging = PinnedRing(3, total, torch.int64) if decoder.device.type == "cuda" else None
        self._hosts = [staging.take() for _ in range(3)] if staging is not None else [torch.zeros(total, dtype=torch.int64)]
        for host in self._hosts:
            host.zero_()
        self._turn = 0
        self._device = torch.zeros(total, dtype=torch.int64, device=decoder.device)
        self._drawn_tokens = torch.zeros(n, dtype=torch.int64, device=decoder.device)  # the last replay's draws
        self._rows = [[None] * n for _ in self._hosts]  # the blocks each table row of each buffer holds
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logits [size, V], greedy draws [2, size]

    def _views(self, size: int):
        n, d = self.max_lanes, self._device
        tables = d[5 * n :].view(n, self.width)
        return d[0:size], d[n : n + size], d[2 * n : 2 * n + size], d[3 * n : 3 * n + size], tables[:size]

    def _feed_rows(self, size: int) -> torch.Tensor:
        return self._device[4 * self.max_lanes : 4 * self.max_lanes + size]

    def _step(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured work of a bucket: tokens (fed rows from the last draws), the step, the greedy draw."""
        tokens, positions, slots, lens, tables = self._views(size)
        feed = self._feed_rows(size)
        tokens = torch.where(feed >= 0, self._drawn_tokens.index_select(0, feed.clamp(min=0)), tokens)
        logits = self.decoder.decode_step(tokens, positions, slots, lens, tables)
        drawn = greedy_draw(logits)  # the draw costs two small kernels a pass
        self._drawn_tokens[:size].copy_(drawn[0])  # read after the fed rows above, in stream order
        return logits, drawn

    def stage(self, pieces: Sequence[Piece], size: int, offsets: Sequence[int] | None = None,
              feed: Sequence[int] | None = None) -> None:
        """Pack the pass's inputs for a bucket of `size` rows into the next staging buffer and copy them to
        the device on the current stream (one transfer)."""
        staged = self._hosts[self._turn]
        self._fill(staged.numpy(), self._rows[self._turn], pieces, size, offsets, feed)
        self._turn = (self._turn + 1) % len(self._hosts)
        self._device.copy_(staged, non_blocking=True)

    def _fill(self, host: np.ndarray, cached: list, pieces: Sequence[Piece], size: int,
              offsets: Sequence[int] | None = None, feed: Sequence[int] | None = None) -> None:
        n, bs, used = self.max_lanes, self.block_size, len(pieces)
        scratch = self.decoder.kv.scratch_block
        starts = np.fromiter((p.start for p in pieces), np.int64, used)
        host[0:used] = np.fromiter((p.tokens[0] for p in pieces), np.int64, used)
        host[n : n + used] = starts if offsets is None else starts + np.asarray(offsets)  # M-RoPE streams rotate past their grids
        host[2 * n : 2 * n + used] = np.fromiter((p.blocks[p.start // bs] * bs + p.start % bs for p in pieces), np.int64, used)
        host[3 * n : 3 * n + used] = starts + 1
        host[4 * n : 4 * n + used] = -1 if feed is None else feed
        # Padding rows: token 0 at position 0, one token of context, in the scratch block; no feed.
        host[used:size], host[n + used : n + size], host[2 * n + used : 2 * n + size] = 0, 0, scratch * bs
        host[3 * n + used : 3 * n + size], host[4 * n + used : 4 * n + size] = 1, -1
        tables = host[5 * n :].reshape(n, self.width)
        for row in range(size):  # a row's table is rewritten only when its blocks change (rarely, in decode)
            blocks = pieces[row].blocks if row < used else ()
            if cached[row] != blocks:
                tables[row] = scratch
                tables[row, : len(blocks)] = blocks
                cached[row] = blocks

    def capture(self, quiet: bool = False) -> None:
        """Capture every bucket's graph (largest first, sharing one memory pool), with a progress line."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.decoder.device)
        stream.wait_stream(torch.cuda.current_stream())
        with Progress("capturing decode graphs", len(self.buckets), stream=None if not quiet else _Null(), unit="buckets") as progress:
            for size in sorted(self.buckets, reverse=True):
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile the kernels and settle the allocator before capture
                        self._step(size)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._outputs[size] = self._step(size)
                self._graphs[size] = graph
                progress.advance()
        torch.cuda.current_stream().wait_stream(stream)

    def fits(self, pieces: Sequence[Piece]) -> bool:
        return 0 < len(pieces) <= self.max_lanes and all(
            len(p.tokens) == 1 and p.logits == "last" and len(p.blocks) <= self.width for p in pieces)

    @property
    def feeds(self) -> bool:
        """Whether a pass can read its tokens from the last one's draws (`run`'s `feed`): with graphs."""
        return bool(self._graphs)

    def run(self, pieces: Sequence[Piece], offsets: Sequence[int] | None = None,
            feed: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the smallest bucket holding `pieces` (decode rows): logits [len(pieces), vocab] and every
        row's greedy draw [2, len(pieces)] (`sampling.greedy_draw`), computed inside the graph.

        `feed`: for each row, the row of the last replay whose draw is its token (that replay may still be
        running; its pieces' tokens are then not read). Not captured (tensor-parallel ranks: their
        collectives stay outside graphs), the same step runs eagerly on exactly the pieces' rows, so its
        collectives have the shapes `Decoder.forward`'s would, and the draw is None (the caller draws).
        `offsets`: each row's rotary position over its index (M-RoPE)."""
        n = len(pieces)
        if not self._graphs:
            if feed is not None:
                raise ValueError("fed rows need captured graphs")
            self.stage(pieces, n, offsets)
            return self.decoder.decode_step(*self._views(n)), None
        size = next(b for b in self.buckets if b >= n)
        self.stage(pieces, size, offsets, feed)
        self._graphs[size].replay()
        logits, drawn = self._outputs[size]
        return logits[:n], drawn[:, :n]


class _Null:
    def write(self, _: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def graphs_enabled(device: torch.device, requested: bool) -> bool:
    """Graphs need CUDA and Triton; asking for them without either is refused by the caller."""
    if not requested or device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        print("lanes: Triton is not installed: decode runs without CUDA graphs", file=sys.stderr)
        return False
    return True
