"""Aggregate tokens/s of the lane core at 1, 8 and 32 concurrent streams beside transformers' generate().

    python bench/engine.py [--model M] [--streams 1,8,32] [--new 32] [--device cpu]

The same prompts (lengths 16..128, fixed seed) go to both: to our engine as concurrent streams over as
many lanes, and to transformers' `generate()` as one left-padded static batch. Greedy, end-of-sequence
ignored. Two workloads: `uniform`, `--new` tokens for every stream; `mixed`, each stream its own budget
of 8..2*`--new` tokens (as a server's requests have), where `generate()` runs the batch to the largest
budget and is credited only with each row's own budget. Prints one table: useful tokens/s for both and
the ratio ours / theirs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import trio

from lanes.core.lane_core import LaneCore
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Finished, Request
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.core.blocks import blocks_for
from lanes.gpu.device import choose, runner_for
from lanes.loader import load_model
from lanes.models import resolve_model

from bench_reference import reference_model


def make_prompts(count: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 129, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


async def ours(model, placement, prompts, budgets: list[int]) -> float:
    backend = TorchBackend(model, runner_for(placement), lanes=len(prompts), max_model_len=1024)
    core = LaneCore(backend, text_factory(model.tokenizer), model.tokenizer.eos_ids, max_rows=512)
    produced = 0

    async def one(prompt, budget):
        nonlocal produced
        sampling = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
        stream = await core.submit(Request(tuple(prompt), sampling))
        async for event in stream.events:
            if isinstance(event, Finished):
                produced += event.completion_tokens

    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        start = time.perf_counter()
        async with trio.open_nursery() as clients:
            for prompt, budget in zip(prompts, budgets):
                clients.start_soon(one, prompt, budget)
        took = time.perf_counter() - start
        await core.shutdown(0)
    core.check_integrity()
    assert produced == sum(budgets)
    return produced / took


def theirs(reference, placement, prompts, budgets: list[int], pad: int) -> float:
    new = max(budgets)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=placement.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=placement.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad)
    if placement.is_cuda:
        torch.cuda.synchronize()
    took = time.perf_counter() - start
    assert out.shape[1] - width == new
    return sum(budgets) / took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    placement = choose(args.device, args.dtype)
    path = resolve_model(args.model)
    most = max(counts)
    model = load_model(path, placement, kv_blocks=most * blocks_for(128 + args.new) + 8)
    print("loading the transformers reference ...", file=sys.stderr)
    reference = reference_model(path, placement)
    pad = model.tokenizer.pad_id if model.tokenizer.pad_id is not None else 0
    prompts = make_prompts(most, model.config.vocab_size)
    mixed = torch.randint(8, 2 * args.new + 1, (most,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = []
    for workload in ("uniform", "mixed"):
        for n in counts:
            budgets = [args.new] * n if workload == "uniform" else mixed[:n]
            print(f"{workload}, {n} streams ...", file=sys.stderr)
            mine = trio.run(ours, model, placement, prompts[:n], budgets)
            rows.append((workload, n, mine, theirs(reference, placement, prompts[:n], budgets, pad)))
    print(f"\nmodel {path.name} on {placement.describe()}, {torch.get_num_threads()} threads, greedy, "
          f"uniform: {args.new} tokens a stream, mixed: 8..{2 * args.new}")
    print(f"{'workload':<9} {'streams':>7} {'lanes tok/s':>12} {'generate() tok/s':>17} {'ratio':>7}")
    for workload, n, mine, ref in rows:
        print(f"{workload:<9} {n:>7} {mine:>12.1f} {ref:>17.1f} {mine / ref:>7.2f}")


if __name__ == "__main__":
    main()
