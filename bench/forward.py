"""Prefill and decode tokens/s of our forward beside transformers' forward of the same model, in one run.

    python bench/forward.py [--model M] [--prompts 4] [--prompt-len 128] [--lanes 8] [--steps 32] [--device cpu]

Both sides run the same checkpoint in the same dtype on the same device and threads. Prefill: `--prompts`
prompts of `--prompt-len` tokens in one pass. Decode: `--lanes` sequences at context `--prompt-len`, one
token each a step (ours through the paged KV cache, transformers through its DynamicCache). Prints one
table with the ratio ours / transformers; the median of `--repeat` timed runs after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from lanes.core.passes import Piece
from lanes.core.blocks import BlockPool, BlockTable
from lanes.gpu.device import choose
from lanes.loader import load_model
from lanes.models import resolve_model

from bench_reference import reference_model


def timed(fn, repeat: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    placement = choose(args.device, args.dtype)
    sync = (lambda: torch.cuda.synchronize()) if placement.is_cuda else (lambda: None)
    path = resolve_model(args.model)
    ours = load_model(path, placement, kv_blocks=(args.lanes + args.prompts) * ((args.prompt_len + args.steps) // 16 + 2))
    print("loading the transformers reference ...", file=sys.stderr)
    theirs = reference_model(path, placement)
    generator = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    prompts = torch.randint(0, vocab, (max(args.prompts, args.lanes), args.prompt_len), generator=generator)
    pool = BlockPool(ours.kv_blocks)

    def ours_prefill():
        tables = [BlockTable(("lane", i)) for i in range(args.prompts)]
        for t in tables:
            t.grow(pool, args.prompt_len)
        ours.decoder.prefill_many([Piece(i, tuple(prompts[i].tolist()), 0, tuple(t.blocks)) for i, t in enumerate(tables)])
        for t in tables:
            t.clear(pool)

    def theirs_prefill():
        with torch.no_grad():
            theirs(prompts[: args.prompts].to(placement.device), logits_to_keep=1)

    def ours_decode():
        tables = [BlockTable(("lane", i)) for i in range(args.lanes)]
        for t in tables:
            t.grow(pool, args.prompt_len)
        last = ours.decoder.prefill_many([Piece(i, tuple(prompts[i].tolist()), 0, tuple(t.blocks)) for i, t in enumerate(tables)])
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            tokens = last.argmax(-1).tolist()
            pieces = []
            for i, t in enumerate(tables):
                t.grow(pool, 1)
                pieces.append(Piece(i, (tokens[i],), t.tokens - 1, tuple(t.blocks)))
            last = ours.decoder.decode(pieces)
        sync()
        for t in tables:
            t.clear(pool)
        return time.perf_counter() - start

    def theirs_decode():
        with torch.no_grad():
            out = theirs(prompts[: args.lanes].to(placement.device), use_cache=True, logits_to_keep=1)
            cache, last = out.past_key_values, out.logits[:, -1]
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                out = theirs(last.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
                cache, last = out.past_key_values, out.logits[:, -1]
            sync()
        return time.perf_counter() - start

    rows = []
    prefill_tokens = args.prompts * args.prompt_len
    a, b = timed(ours_prefill, args.repeat, sync), timed(theirs_prefill, args.repeat, sync)
    rows.append((f"prefill {args.prompts}x{args.prompt_len}", prefill_tokens / a, prefill_tokens / b))
    ours_decode()
    theirs_decode()
    a = statistics.median(ours_decode() for _ in range(args.repeat))
    b = statistics.median(theirs_decode() for _ in range(args.repeat))
    decode_tokens = args.lanes * args.steps
    rows.append((f"decode {args.lanes} lanes @{args.prompt_len}", decode_tokens / a, decode_tokens / b))
    pool.check_integrity()

    print(f"\nmodel {path.name} on {placement.describe()}, {torch.get_num_threads()} threads")
    print(f"{'phase':<24} {'lanes tok/s':>12} {'transformers tok/s':>19} {'ratio':>7}")
    for name, mine, ref in rows:
        print(f"{name:<24} {mine:>12.1f} {ref:>19.1f} {mine / ref:>7.2f}")


if __name__ == "__main__":
    main()
