"""A draft model (`--draft-model PATH`): a small model with the target's tokenizer proposes each lane's draft.

It keeps a lane of its own for each drafting stream, in a KV pool of its own. Before a target pass
(`prepare`, in a worker thread, so the event loop runs on): each lane is caught up with the context its
stream has now (the tokens its KV holds that the target kept stay; the rest is written again from where
they differ, which is how a rejected draft rolls back: nothing is copied), then `k` greedy steps draw its
draft, every lane batched in each step. Streams with images draft nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import trio

from ..core.blocks import BlockPool, BlockTable, blocks_for
from ..core.passes import Piece

MAX_ROWS = 256  # catch-up rows a draft-model pass carries at most (a long prompt goes in chunks)


@dataclass
class _Lane:
    table: BlockTable
    written: list[int] = field(default_factory=list)  # the tokens whose KV the lane's blocks hold, in order


class DraftModel:
    """A `DraftSource` over a loaded model (`lanes.loader.load_model`, its KV pool the draft lanes' own)."""

    def __init__(self, model) -> None:
        self.model, self.decoder = model, model.decoder
        kv = model.decoder.kv
        self.pool = BlockPool(model.kv_blocks, kv.shape.block_size)
        self._lanes: dict[int, _Lane] = {}  # job id -> its draft lane
        self._ready: dict[int, tuple[int, ...]] = {}  # job id -> its draft for the pass being planned
        self._limiter = trio.CapacityLimiter(1)

    async def prepare(self, jobs, lengths: dict[int, int]) -> None:
        """Draw the drafts of the jobs `lengths` gives a length (off the event loop)."""
        wanted = []
        for job in jobs:
            k = min(lengths.get(job.id, 0), job.max_new - len(job.generated) - 1)  # never past max_tokens
            if k > 0 and not job.media and self._room(job):
                wanted.append((job.id, (*job.prompt, *job.generated), k))  # a copy: the thread reads no job
        self._ready = await trio.to_thread.run_sync(self._draft, wanted, limiter=self._limiter) if wanted else {}

    def propose(self, job, most: int) -> tuple[int, ...]:
        return self._ready.get(job.id, ())[:most]

    def forget(self, job) -> None:
        lane = self._lanes.pop(job.id, None)
        if lane is not None:
            lane.table.clear(self.pool)

    def _room(self, job) -> bool:
        """Whether the job has a draft lane, or one can be made for its whole context."""
        if job.id in self._lanes:
            return True
        need = blocks_for(job.limit, self.pool.block_size)
        if not self.pool.can_allocate(need):
            return False
        table = BlockTable(("draft", job.id))
        table.reserve(self.pool, job.limit)
        self._lanes[job.id] = _Lane(table)
        return True

    @torch.inference_mode()
    def _draft(self, wanted: list[tuple[int, tuple[int, ...], int]]) -> dict[int, tuple[int, ...]]:
        """Each (job id, context, k): catch its lane up with the context, then k greedy steps."""
        drafts: dict[int, list[int]] = {job_id: [] for job_id, _, _ in wanted}
        behind = {}
        for job_id, context, _ in wanted:
            lane = self._lanes[job_id]
            kept = 0
            for mine, theirs in zip(lane.written, context):
                if mine != theirs:
                    break
                kept += 1
            kept = min(kept, len(context) - 1)  # the last token is always run again: its logits draw the draft
            del lane.written[kept:]
            behind[job_id] = list(context[kept:])
        while behind:  # the catch-up, in chunks of at most MAX_ROWS rows a pass
            pieces, budget = [], MAX_ROWS
            for job_id, tokens in behind.items():
                take = min(len(tokens), budget)
                if take == 0:
                    break
                pieces.append((job_id, tokens[:take], take == len(tokens)))
                budget -= take
            firsts = self._step([(job_id, chunk) for job_id, chunk, _ in pieces])
            for (job_id, chunk, last), token in zip(pieces, firsts):
                del behind[job_id][: len(chunk)]
                if last:
                    drafts[job_id].append(token)
                    del behind[job_id]
        steps = {job_id: k for job_id, _, k in wanted}
        while True:
            going = [(job_id, [draft[-1]]) for job_id, draft in drafts.items() if len(draft) < steps[job_id]]
            if not going:
                return {job_id: tuple(draft) for job_id, draft in drafts.items()}
            for (job_id, _), token in zip(going, self._step(going)):
                drafts[job_id].append(token)

    def _step(self, chunks: list[tuple[int, list[int]]]) -> list[int]:
        """One draft-model pass: each lane's chunk written after what its KV holds; each one's greedy draw."""
        pieces = []
        for slot, (job_id, tokens) in enumerate(chunks):
            lane = self._lanes[job_id]
            pieces.append(Piece(slot, tuple(tokens), len(lane.written), tuple(lane.table.blocks)))
            lane.written.extend(tokens)
        logits = self.decoder.forward(pieces)  # [len(chunks), vocab]: each piece's last row
        return logits.float().argmax(dim=-1).tolist()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held = sum(len(self.pool.held(("draft", job_id))) for job_id in self._lanes)
        if held != self.pool.total - self.pool.free:
            raise AssertionError(f"draft lanes hold {held} blocks, the pool {self.pool.total - self.pool.free}")
