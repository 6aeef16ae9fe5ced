"""Decode passes as CUDA graphs: one graph a batch-size bucket, captured once at start-up, replayed a pass.

Each graph runs the decoder's fast decode step (`Decoder.decode_step`: Triton kernels, paged attention
reading block tables on the device) on static input buffers. A pass packs its lanes' token ids,
positions, slots, lengths and block tables into one host buffer, copies it to the device in one
transfer, and replays the smallest bucket that holds it; padding rows write only the scratch block.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
import torch

from ..core.passes import Piece
from ..core.sampling import greedy_draw
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
        # tokens, positions, slots, lengths: [4, n]; then tables: [n, width] (all int64, one transfer).
        # Pageable on purpose: pinned memory made the caching host allocator record events on the pass's
        # stream at free time, which failed (invalid device context) for streams made by cuda-python.
        self._host = torch.zeros(4 * n + n * self.width, dtype=torch.int64)
        self._host_np = self._host.numpy()
        self._device = torch.zeros_like(self._host, device=decoder.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logits [size, V], greedy draws [2, size]

    def _views(self, size: int):
        n, d = self.max_lanes, self._device
        tables = d[4 * n :].view(n, self.width)
        return d[0:size], d[n : n + size], d[2 * n : 2 * n + size], d[3 * n : 3 * n + size], tables[:size]

    def _fill(self, pieces: Sequence[Piece], size: int, offsets: Sequence[int] | None = None) -> None:
        n, host, bs = self.max_lanes, self._host_np, self.block_size
        scratch = self.decoder.kv.scratch_block
        tables = host[4 * n :].reshape(n, self.width)
        tables[:size] = scratch
        host[3 * n : 3 * n + size] = 1  # padding rows: one token of context, in the scratch block
        host[2 * n : 2 * n + size] = scratch * bs
        host[0:size] = 0
        host[n : n + size] = 0
        for row, piece in enumerate(pieces):
            position = piece.start
            host[row] = piece.tokens[0]
            host[n + row] = position + (offsets[row] if offsets is not None else 0)  # M-RoPE streams rotate past their grids
            host[2 * n + row] = piece.blocks[position // bs] * bs + position % bs
            host[3 * n + row] = position + 1
            tables[row, : len(piece.blocks)] = piece.blocks

    def capture(self, quiet: bool = False) -> None:
        """Capture every bucket's graph (largest first, sharing one memory pool), with a progress line."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.decoder.device)
        stream.wait_stream(torch.cuda.current_stream())
        with Progress("capturing decode graphs", len(self.buckets), stream=None if not quiet else _Null(), unit="buckets") as progress:
            for size in sorted(self.buckets, reverse=True):
                inputs = self._views(size)
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile the kernels and settle the allocator before capture
                        greedy_draw(self.decoder.decode_step(*inputs))
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.decoder.decode_step(*inputs)
                    self._outputs[size] = logits, greedy_draw(logits)  # the draw costs two small kernels a pass
                self._graphs[size] = graph
                progress.advance()
        torch.cuda.current_stream().wait_stream(stream)

    def fits(self, pieces: Sequence[Piece]) -> bool:
        return 0 < len(pieces) <= self.max_lanes and all(
            len(p.tokens) == 1 and p.logits == "last" and len(p.blocks) <= self.width for p in pieces)

    def run(self, pieces: Sequence[Piece], offsets: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the smallest bucket holding `pieces` (decode rows): logits [len(pieces), vocab] and every
        row's greedy draw [2, len(pieces)] (`sampling.greedy_draw`), computed inside the graph.

        Not captured (tensor-parallel ranks: their collectives stay outside graphs), the same step runs
        eagerly on exactly the pieces' rows, so its collectives have the shapes `Decoder.forward`'s would,
        and the draw is None (the caller draws). `offsets`: each row's rotary position over its index (M-RoPE)."""
        n = len(pieces)
        if not self._graphs:
            self._fill(pieces, n, offsets)
            self._device.copy_(self._host)
            return self.decoder.decode_step(*self._views(n)), None
        size = next(b for b in self.buckets if b >= n)
        self._fill(pieces, size, offsets)
        self._device.copy_(self._host)  # one small transfer, ordered on the pass's stream
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
