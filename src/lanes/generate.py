"""A greedy continuation of one prompt straight through the passes: the quick check behind `lanes generate`."""

from __future__ import annotations

from typing import AsyncIterator, Sequence

import torch

from .core.passes import Piece
from .core.blocks import BlockPool, BlockTable
from .gpu.device import CpuRunner, CudaRunner
from .loader import LoadedModel


async def greedy(model: LoadedModel, runner: CpuRunner | CudaRunner, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[int]:
    """Yield up to `max_tokens` greedy tokens after `prompt`, stopping after an end-of-sequence token."""
    if not prompt:
        raise ValueError("the prompt is empty")
    pool = BlockPool(model.kv_blocks)
    table = BlockTable(("lane", 0))
    stop = model.tokenizer.eos_ids | set(model.config.eos_token_ids)
    decoder = model.decoder

    def step(tokens: Sequence[int], start: int) -> int:
        # One pass; the argmax is the pass's one host sync.
        logits = decoder.forward([Piece(0, tuple(tokens), start, tuple(table.blocks))])
        return int(torch.argmax(logits[0]).item())

    try:
        table.grow(pool, len(prompt))
        token = await runner.run(lambda: step(prompt, 0))
        for produced in range(max_tokens):
            yield token
            if token in stop or produced + 1 == max_tokens:
                return
            table.grow(pool, 1)
            token = await runner.run(lambda: step([token], table.tokens - 1))
    finally:
        table.clear(pool)
        pool.check_integrity()
