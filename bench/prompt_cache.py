"""Time to first token with the prompt cache and without it, in one run: 16 questions behind one shared
system prompt of about 2,000 tokens, asked one after another (the default model on the CPU unless told).

    python bench/prompt_cache.py [--model M] [--questions 16] [--device cpu]

Prints one table: mean time to first token of the first question and of the others, with and without the
cache, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import trio

from lanes.core.lane_core import LaneCore
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Request, TokenEvent
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import choose, runner_for
from lanes.loader import load_model
from lanes.models import resolve_model

PARAGRAPH = ("The archive keeps records of every shipment that left the northern harbour between the spring floods and "
             "the first frost, with the name of the vessel, its captain, its cargo and the price paid at the quay. ")


async def ask_all(model, placement, prompts, cache_bytes: int) -> list[float]:
    backend = TorchBackend(model, runner_for(placement), lanes=4, max_model_len=4096)
    core = LaneCore(backend, text_factory(model.tokenizer), model.tokenizer.eos_ids, max_rows=512, cache_bytes=cache_bytes)
    sampling = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    firsts = []
    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        for prompt in prompts:
            start = time.perf_counter()
            stream = await core.submit(Request(tuple(prompt), sampling))
            async for event in stream.events:
                if isinstance(event, TokenEvent):
                    firsts.append(time.perf_counter() - start)
                    break
            await stream.aclose()
            print(f"  question {len(firsts)}: {firsts[-1] * 1e3:.0f} ms", file=sys.stderr)
        await core.shutdown(0)
    core.check_integrity()
    return firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    placement = choose(args.device, args.dtype)
    path = resolve_model(args.model)
    model = load_model(path, placement, kv_blocks=1400)
    tokenizer = model.tokenizer
    system = PARAGRAPH * 50
    prompts = []
    for i in range(args.questions):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: which ship left {i} days after the floods?"}]
        prompts.append(tokenizer.encode_prompt(tokenizer.render_chat(messages)))
    shared = len(tokenizer.encode_prompt(tokenizer.render_chat([{"role": "system", "content": system}], add_generation_prompt=False)))
    rows = []
    for name, cache_bytes in (("without cache", 0), ("with cache", 1 << 40)):
        print(f"{name} ...", file=sys.stderr)
        firsts = trio.run(ask_all, model, placement, prompts, cache_bytes)
        rows.append((name, firsts[0], statistics.mean(firsts[1:])))
    print(f"\nmodel {path.name} on {placement.describe()}; {args.questions} questions of {len(prompts[0])}-{len(prompts[-1])} tokens "
          f"sharing a {shared}-token system prompt, asked one after another")
    print(f"{'':<14} {'first ttft ms':>14} {'others ttft ms':>15}")
    for name, first, others in rows:
        print(f"{name:<14} {first * 1e3:>14.0f} {others * 1e3:>15.0f}")
    print(f"{'ratio':<14} {rows[0][1] / rows[1][1]:>14.2f} {rows[0][2] / rows[1][2]:>15.2f}")


if __name__ == "__main__":
    main()
