"""Passes as CUDA graphs: one graph a row-count bucket, captured once at start-up, replayed a pass.

Each graph runs the decoder's fast step (`Decoder.decode_step`: Triton kernels, paged attention reading
block tables on the device) on static input buffers. A pass packs its rows' token ids, positions,
slots, lengths, feed rows and table rows, its logit rows and its lanes' block tables into one host
buffer, copies it to the device in one transfer, and replays the smallest bucket that holds it; padding
rows write only the scratch block. Decode rows are one a lane; a pass may also carry short prompts,
whose rows attend causally through their lane's table (their Python cost eagerly is ~15 ms a pass), and
drafted lanes' 1 + k rows, which are the same thing: rows at their own positions over the lane's table,
every one of them with its logits. Every graph leaves its greedy draws (one a logit row) in one device
buffer, where a row with a feed row reads its token (a `fed` plan: the pass is queued before the host has
seen the draws of the one before it), and a drafted pass's greedy acceptance is read from.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
import torch

from ..core.passes import Piece
from .transfer import PinnedRing
from ..progress import Progress
from ..quant.native import available

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # decode passes: one row a lane
ROW_BUCKETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 2560)  # passes that carry prompt rows
PROMPT_ROWS = 2560  # 16 prompts of 128 tokens beside 64 decode rows, and some room
# Prompt rows read their context one row at a time (no reuse across a prompt's rows, as a prefill
# kernel has): past this many context tokens read in a pass, the general forward's attention is cheaper.
PROMPT_ATTENTION = 1 << 19


def greedy_draw(logits: torch.Tensor) -> torch.Tensor:
    """logits: [R, V] any float dtype -> [2, R] float64: each row's argmax and its logprob, computed with
    the same ops as `lanes.backend.draws.sample` (so bit for bit the same), packed for one read-back (ids are exact in float64)."""
    raw = logits.float()  # [R, V] float32
    if raw.device.type == "cpu" and available():  # one op: argmax and log_softmax's value, as draws.log_softmax's
        return torch.ops.lanes_quant.greedy(raw)
    tokens = raw.argmax(dim=-1)  # [R] int64
    chosen = torch.log_softmax(raw, dim=-1).gather(1, tokens[:, None]).squeeze(1)  # [R] float32
    return torch.stack([tokens.double(), chosen.double()])


class DecodeGraphs:
    """Captured steps for every bucket up to `max_lanes` decode rows, and with `prompt_rows` also for
    passes of up to that many rows that carry short prompts or drafted lanes (their rows attend causally
    through the lane's table row, and only the rows whose logits are asked for reach the head: at most
    `max_logits`, every row of `max_lanes` lanes drafting `draft_tokens` each)."""

    def __init__(self, decoder, max_lanes: int, max_model_len: int, prompt_rows: int = 0, draft_tokens: int = 0) -> None:
        self.decoder = decoder
        kv = decoder.kv
        self.block_size = kv.shape.block_size
        self.width = -(-max_model_len // self.block_size)  # blocks in a table row
        self.buckets = [b for b in BUCKETS if b < max_lanes] + [max_lanes]
        if prompt_rows > max_lanes:
            self.buckets += [b for b in ROW_BUCKETS if max_lanes < b < prompt_rows] + [prompt_rows]
        self.max_lanes, self.max_rows, self.prompts = max_lanes, self.buckets[-1], prompt_rows > 0
        self.max_logits = min(max_lanes * (1 + draft_tokens), self.max_rows)
        self.passes = {"decode": 0, "prompt": 0, "drafted": 0}  # passes run (replayed where captured), by their rows
        r, n, m = self.max_rows, max_lanes, self.max_logits
        # Rows (tokens, positions, slots, lengths, feed rows, table rows): [6, r]; logit rows [m]; tables
        # [n, width] (int64, one transfer). On CUDA staged in page-locked buffers taken in turn: the copy of a
        # pass queued behind the running one may not have run when the next is packed (two in flight at most).
        total = 6 * r + m + n * self.width
        staging = PinnedRing(3, total, torch.int64) if decoder.device.type == "cuda" else None
        self._hosts = [staging.take() for _ in range(3)] if staging is not None else [torch.zeros(total, dtype=torch.int64)]
        for host in self._hosts:
            host.zero_()
        self._turn = 0
        self._device = torch.zeros(total, dtype=torch.int64, device=decoder.device)
        self._drawn_tokens = torch.zeros(m, dtype=torch.int64, device=decoder.device)  # the last replay's draws
        self._rows = [[None] * n for _ in self._hosts]  # the blocks each table row of each buffer holds
        self._count = np.arange(r, dtype=np.int64)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logits [size, V], greedy draws [2, size]
        self._arrivals: dict[int, dict] = {}  # each graph's own arrival counters (kernels.arrival_scope)

    def _views(self, size: int, outputs: int | None = None):
        """decode_step's inputs for a bucket of `size` rows; `outputs` logit rows (default: as many as fit)."""
        r, n, m, d = self.max_rows, self.max_lanes, self.max_logits, self._device
        rows = [d[i * r : i * r + size] for i in (0, 1, 2, 3)]
        tables = d[6 * r + m :].view(n, self.width)
        logit_rows = d[6 * r : 6 * r + (min(size, m) if outputs is None else outputs)]
        return (*rows, tables, d[5 * r : 5 * r + size], logit_rows)

    def _feed_rows(self, size: int) -> torch.Tensor:
        return self._device[4 * self.max_rows : 4 * self.max_rows + size]

    def _step(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured work of a bucket: tokens (fed rows from the last draws), the step, the greedy draw."""
        logits = self.decoder.decode_step(*self._views(size), fed=(self._feed_rows(size), self._drawn_tokens))
        drawn = greedy_draw(logits)  # the draw costs two small kernels a pass
        self._drawn_tokens[: drawn.shape[1]].copy_(drawn[0])  # read after the fed rows above, in stream order
        return logits, drawn

    def stage(self, pieces: Sequence[Piece], size: int, offsets: Sequence[int] | None = None,
              feed: Sequence[int] | None = None) -> None:
        """Pack the pass's inputs for a bucket of `size` rows into the next staging buffer and copy them to
        the device on the current stream (one transfer)."""
        staged = self._hosts[self._turn]
        if feed is not None or all(len(p.tokens) == 1 for p in pieces):  # fed rows are decode rows
            self._fill(staged.numpy(), self._rows[self._turn], pieces, size, offsets, feed)
        else:
            self._fill_prompts(staged.numpy(), self._rows[self._turn], pieces, size, offsets)
        self._turn = (self._turn + 1) % len(self._hosts)
        self._device.copy_(staged, non_blocking=True)

    def _fill(self, host: np.ndarray, cached: list, pieces: Sequence[Piece], size: int,
              offsets: Sequence[int] | None = None, feed: Sequence[int] | None = None) -> None:
        """Decode rows, one a piece (the hot path: a few vectorised writes)."""
        r, bs, used = self.max_rows, self.block_size, len(pieces)
        scratch = self.decoder.kv.scratch_block
        self._tables(host, cached, pieces, size)  # first: a row's slot is read from its table row
        starts = np.fromiter((p.start for p in pieces), np.int64, used)
        if feed is None:
            host[0:used] = np.fromiter((p.tokens[0] for p in pieces), np.int64, used)
        else:
            host[0:used], host[4 * r : 4 * r + used] = 0, feed  # fed rows: their tokens are read on the device
        host[r : r + used] = starts if offsets is None else starts + np.asarray(offsets)  # M-RoPE streams rotate past their grids
        tables = host[6 * r + self.max_logits :].reshape(self.max_lanes, self.width)
        host[2 * r : 2 * r + used] = tables[self._count[:used], starts // bs] * bs + starts % bs
        host[3 * r : 3 * r + used] = starts + 1
        if feed is None:
            host[4 * r : 4 * r + used] = -1
        # Padding rows: token 0 at position 0, one token of context, in the scratch block; no feed.
        host[used:size], host[r + used : r + size], host[2 * r + used : 2 * r + size] = 0, 0, scratch * bs
        host[3 * r + used : 3 * r + size], host[4 * r + used : 4 * r + size] = 1, -1
        host[5 * r : 5 * r + size] = self._count[:size]  # every row its own table row
        outputs = min(size, self.max_logits)
        host[6 * r : 6 * r + outputs] = self._count[:outputs]

    def _fill_prompts(self, host: np.ndarray, cached: list, pieces: Sequence[Piece], size: int,
                      offsets: Sequence[int] | None = None) -> None:
        """Rows of prompts, drafted lanes and decode rows: a piece's rows share its table row; the head reads
        each piece's last row, or all its rows, as its logits ask."""
        r, bs = self.max_rows, self.block_size
        at = out = 0
        for i, p in enumerate(pieces):
            k, positions = len(p.tokens), np.arange(p.start, p.end, dtype=np.int64)
            host[at : at + k] = p.tokens
            host[r + at : r + at + k] = positions if offsets is None else positions + offsets[i]
            host[2 * r + at : 2 * r + at + k] = np.asarray(p.blocks, dtype=np.int64)[positions // bs] * bs + positions % bs
            host[3 * r + at : 3 * r + at + k] = positions + 1
            host[5 * r + at : 5 * r + at + k] = i
            if p.logits == "last":
                host[6 * r + out] = at + k - 1
                out += 1
            elif p.logits == "all":
                host[6 * r + out : 6 * r + out + k] = self._count[at : at + k]
                out += k
            at += k
        host[4 * r : 4 * r + size] = -1
        scratch = self.decoder.kv.scratch_block
        host[at:size], host[r + at : r + size], host[2 * r + at : 2 * r + size] = 0, 0, scratch * bs
        host[3 * r + at : 3 * r + size], host[5 * r + at : 5 * r + size] = 1, 0  # padding: the scratch slot
        host[6 * r + out : 6 * r + min(size, self.max_logits)] = 0
        self._tables(host, cached, pieces, len(pieces))

    def _tables(self, host: np.ndarray, cached: list, pieces: Sequence[Piece], count: int) -> None:
        """Table rows 0..count: a row is rewritten only when its blocks change (rarely, in decode)."""
        r, n, scratch = self.max_rows, self.max_lanes, self.decoder.kv.scratch_block
        tables = host[6 * r + self.max_logits :].reshape(n, self.width)
        for row in range(count):
            blocks = pieces[row].blocks if row < len(pieces) else ()
            if cached[row] is not blocks and cached[row] != blocks:
                tables[row] = scratch
                tables[row, : len(blocks)] = blocks
                cached[row] = blocks

    def capture(self, quiet: bool = False) -> None:
        """Capture every bucket's graph (largest first, sharing one memory pool), with a progress line. A
        decoder with a part a graph cannot hold (`graph_safe`: MoE's experts without a fused grouped product) stays uncaptured."""
        if not self.decoder.graph_safe:
            if not quiet:
                print("lanes: decode graphs not captured: the MoE layers' grouped experts read their row counts on "
                      "the host (no fused grouped product for this GPU and dtype); the fast step runs uncaptured", file=sys.stderr)
            return
        from .kernels import arrival_scope  # Triton's: a CPU install has none, and never captures

        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.decoder.device)
        stream.wait_stream(torch.cuda.current_stream())
        with Progress("capturing decode graphs", len(self.buckets), stream=None if not quiet else _Null(), unit="buckets") as progress:
            for size in sorted(self.buckets, reverse=True):
                counters = self._arrivals.setdefault(size, {})
                with torch.cuda.stream(stream), arrival_scope(counters):
                    for _ in range(2):  # compile the kernels and settle the allocator before capture
                        self._step(size)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream), arrival_scope(counters):
                    self._outputs[size] = self._step(size)
                with torch.cuda.stream(stream):
                    graph.replay()  # a graph's first launch uploads it (milliseconds): here, not in a pass
                self._graphs[size] = graph
                progress.advance()
        torch.cuda.current_stream().wait_stream(stream)

    def fits(self, pieces: Sequence[Piece]) -> bool:
        """Decode rows, one a lane; or, with prompts, up to `max_rows` rows whose prompts (and drafts) are
        short enough, with at most `max_logits` rows whose logits are asked for."""
        if not 0 < len(pieces) <= self.max_lanes:
            return False
        if all(len(p.tokens) == 1 and p.logits == "last" and len(p.blocks) <= self.width for p in pieces):
            return True
        if not self.prompts:
            return False
        rows = attention = outputs = 0
        for p in pieces:
            if len(p.blocks) > self.width:
                return False
            rows += len(p.tokens)
            outputs += p.logit_rows
            attention += len(p.tokens) * p.end if len(p.tokens) > 1 else 0
        return rows <= self.max_rows and outputs <= self.max_logits and attention <= PROMPT_ATTENTION

    @property
    def feeds(self) -> bool:
        """Whether a pass can read its tokens from the last one's draws (`run`'s `feed`): with graphs."""
        return bool(self._graphs)

    def run(self, pieces: Sequence[Piece], offsets: Sequence[int] | None = None,
            feed: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the smallest bucket holding `pieces` (`fits`): logits [R, vocab] of the rows whose logits
        are asked for (each "last" piece's last row, each "all" piece's every row, in order) and their greedy
        draws [2, R] (`sampling.greedy_draw`), computed inside the graph.

        `feed`: for each row, the row of the last replay whose draw is its token (that replay may still be
        running; its pieces' tokens are then not read). Not captured (tensor-parallel ranks: their
        collectives stay outside graphs), the same step runs eagerly on exactly the pieces' rows, so its
        collectives have the shapes `Decoder.forward`'s would, and the draw is None (the caller draws).
        `offsets`: each piece's rotary position over its index (M-RoPE decode rows)."""
        if feed is not None:  # fed rows are decode rows
            rows = outputs = len(pieces)
        else:
            rows, outputs = sum(len(p.tokens) for p in pieces), sum(p.logit_rows for p in pieces)
        if rows == len(pieces):
            self.passes["decode"] += 1
        else:  # "drafted": some lane's every row read (a draft's, or a prompt's logprobs)
            self.passes["drafted" if any(p.logits == "all" and len(p.tokens) > 1 for p in pieces) else "prompt"] += 1
        if not self._graphs:
            if feed is not None:
                raise ValueError("fed rows need captured graphs")
            self.stage(pieces, rows, offsets)
            return self.decoder.decode_step(*self._views(rows, outputs)), None
        size = next(b for b in self.buckets if b >= rows)
        self.stage(pieces, size, offsets, feed)
        self._graphs[size].replay()
        logits, drawn = self._outputs[size]
        return logits[:outputs], drawn[:, :outputs]


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
