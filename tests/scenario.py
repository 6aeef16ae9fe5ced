"""A ragged pass scenario for families tests: prompts prefilled together (one in two chunks), then decoded."""

from __future__ import annotations

from typing import Sequence

import torch

from lanes.core.passes import Piece
from lanes.core.blocks import BlockPool, BlockTable



def prompts(vocab: int, lengths: Sequence[int] = (21, 3, 37, 16), seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def run(decoder, pool: BlockPool, prompt_ids: Sequence[Sequence[int]], steps: int = 16, chunk: int = 20):
    """Prefill every prompt in one pass (the longest one in chunks of `chunk` rows, over several passes),
    then decode `steps` greedy tokens for every lane together, lanes at different lengths.

    Returns (prompt logits per lane [n, V], decode logits per step [lanes, V], tokens per lane).
    """
    tables = [BlockTable(("lane", i)) for i in range(len(prompt_ids))]
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    prompt_logits: list[list[torch.Tensor]] = [[] for _ in prompt_ids]
    done = [0] * len(prompt_ids)
    while any(done[i] < len(p) for i, p in enumerate(prompt_ids)):
        pieces = []
        for i, p in enumerate(prompt_ids):
            if done[i] == len(p):
                continue
            take = chunk if i == longest else len(p)
            tokens = p[done[i] : done[i] + take]
            tables[i].grow(pool, len(tokens))
            pieces.append(Piece(i, tuple(tokens), done[i], tuple(tables[i].blocks), "all"))
        logits = decoder.forward(pieces)
        row = 0
        for piece in pieces:
            prompt_logits[piece.lane].append(logits[row : row + len(piece.tokens)])
            row += len(piece.tokens)
            done[piece.lane] = piece.end
    prompt_out = [torch.cat(parts) for parts in prompt_logits]
    sequences = [list(p) for p in prompt_ids]
    last = torch.stack([out[-1] for out in prompt_out])
    step_logits = []
    for _ in range(steps):
        pieces = []
        for i, token in enumerate(last.argmax(-1).tolist()):
            sequences[i].append(token)
            tables[i].grow(pool, 1)
            pieces.append(Piece(i, (token,), len(sequences[i]) - 1, tuple(tables[i].blocks)))
        last = decoder.forward(pieces)
        step_logits.append(last)
    for table in tables:
        table.clear(pool)
    return prompt_out, step_logits, sequences


def reference(model, prompt_ids: Sequence[Sequence[int]], sequences: Sequence[Sequence[int]], steps: int, device: str = "cpu"):
    """transformers' logits for the same rows: each prompt's rows, and each decode step's last row."""
    with torch.no_grad():
        prompt_out = [model(torch.tensor([p], device=device)).logits[0].float() for p in prompt_ids]
        step_logits = []
        for step in range(steps):
            rows = [model(torch.tensor([s[: len(p) + step + 1]], device=device)).logits[0, -1] for p, s in zip(prompt_ids, sequences)]
            step_logits.append(torch.stack(rows).float())
        model.generation_config.eos_token_id = None  # the scenario decodes through end-of-sequence tokens
        greedy = [model.generate(torch.tensor([p], device=device), attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                                 max_new_tokens=steps, do_sample=False, pad_token_id=0)[0].tolist() for p in prompt_ids]
    return prompt_out, step_logits, greedy


def assert_same_greedy(prompt_ids, ours, theirs, atol: float = 1e-4) -> None:
    """Our greedy tokens (`ours[2]`) are transformers' generate()'s (`theirs[2]`) up to a row of its logits
    (`theirs[0]`, `theirs[1]`, along our tokens) whose best two are within `atol`: a tie at rounding level
    that either side may break. From there each of ours need only be among that row's best within `atol`."""
    for lane, prompt in enumerate(prompt_ids):
        mine, generated = ours[2][lane], theirs[2][lane]
        assert len(mine) == len(generated) and mine[: len(prompt)] == generated[: len(prompt)]
        rows = [theirs[0][lane][-1]] + [step[lane] for step in theirs[1]]
        tied = False
        for at, token in enumerate(mine[len(prompt) :]):
            best, second = rows[at].topk(2).values.tolist()
            assert rows[at][token] >= best - atol, (lane, at, token)
            tied = tied or best - second <= atol
            assert tied or token == generated[len(prompt) + at], (lane, at, token)


def assert_equals_transformers(model, transformers_model, steps: int = 8) -> None:
    """Ragged prompts prefilled (one in chunks), then decoded, against transformers: logits within 1e-4
    and the same greedy tokens, with every block back in the pool."""
    pool = BlockPool(model.kv_blocks)
    prompt_ids = prompts(model.config.vocab_size)
    ours = run(model.decoder, pool, prompt_ids, steps=steps)
    theirs = reference(transformers_model, prompt_ids, ours[2], steps=steps)
    for mine, ref in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-4)
    assert_same_greedy(prompt_ids, ours, theirs)
    pool.check_integrity()
    assert pool.free == pool.total


def lanes_after_prefill(model, lengths):
    """Random prompts of `lengths` prefilled in one pass, each in a table with room for 16 more tokens:
    (pool, tables, the lanes' lengths, each lane's greedy next token)."""
    pool = BlockPool(model.kv_blocks)
    tables, pieces = [], []
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate(lengths):
        table = BlockTable(("lane", i))
        table.reserve(pool, n + 16)
        tables.append(table)
        prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        pieces.append(Piece(i, tuple(prompt), 0, tuple(table.blocks)))
    last = model.decoder.forward(pieces)
    return pool, tables, [p.end for p in pieces], last.argmax(-1).tolist()
