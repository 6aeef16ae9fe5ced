"""Drafted equals plain on the default model: the same requests with drafts off and on give the same tokens
(and logprobs within 1e-5), greedy and seeded, for draft lengths 1 to 8, at 1, 8 and 32 streams at once.

    python bench/drafts_exact.py [--prompts 200] [--new 64] [--streams 1,8,32] [--tokens 1,4,8] [--methods ngram,suffix,model]
                                 [--dequantize]

Prompts alternate the two workloads of bench/drafts.py; seeded rows sample at temperature 0.8, top-p 0.9.
Load control is off here, so every lane drafts its full length whenever its source finds a draft. Prints
one line a setting: requests whose tokens equal the plain run's (at the largest concurrency), and the largest
logprob difference; `off` lines are plain runs at another concurrency. `model` drafts with a second copy of
the default model (the same tokenizer, so every greedy draft is right). `--dequantize` reads the GGUF
file's blocks as fp32 tensors, as an AVX2 host does anyway: the fp32 products' regime.
"""

from __future__ import annotations

import argparse
import sys

import trio

from drafts import workloads
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.core.blocks import blocks_for
from lanes.core.lane_core import LaneCore
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Request, TokenEvent
from lanes.drafts.model import DraftModel
from lanes.drafts.ngram import NgramDrafter
from lanes.drafts.suffix import SuffixDrafter
from lanes.gpu.device import choose, runner_for
from lanes.loader import load_model
from lanes.models import DEFAULT_MODEL, resolve_model


async def run(model, placement, requests: list[Request], at_once: int, drafts, most: int) -> list[list]:
    backend = TorchBackend(model, runner_for(placement), lanes=at_once, max_model_len=1024)
    core = LaneCore(backend, text_factory(model.tokenizer), model.tokenizer.eos_ids, max_rows=512,
                    drafts=drafts, draft_tokens=most, draft_control=False)
    out: list[list] = [[] for _ in requests]
    limiter = trio.Semaphore(at_once)

    async def one(i: int) -> None:
        async with limiter:
            stream = await core.submit(requests[i])
            out[i] = [(e.token, e.logprob) async for e in stream.events if isinstance(e, TokenEvent)]

    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        async with trio.open_nursery() as clients:
            for i in range(len(requests)):
                clients.start_soon(one, i)
        await core.shutdown(0)
    core.check_stopped()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--tokens", default="1,4,8")
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--dequantize", action="store_true", help="the GGUF blocks read as fp32 tensors")
    args = parser.parse_args()
    placement = choose("cpu", "fp32")
    counts = [int(n) for n in args.streams.split(",")]
    model = load_model(resolve_model(DEFAULT_MODEL), placement, kv_blocks=max(counts) * blocks_for(1024),
                       dequantize=args.dequantize)
    texts = [t for pair in zip(*workloads().values()) for t in pair]
    texts = (texts * (args.prompts // len(texts) + 1))[: args.prompts]
    requests = []
    for i, text in enumerate(texts):
        prompt = tuple(model.tokenizer.encode_chat([{"role": "user", "content": f"{text} ({i})"}]))
        params = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.8, top_p=0.9, seed=i)
        requests.append(Request(prompt, SamplingParams(max_tokens=args.new, logprobs=True, **params)))
    sources = {"ngram": NgramDrafter, "suffix": SuffixDrafter, "model": lambda: DraftModel(
        load_model(resolve_model(DEFAULT_MODEL), placement, kv_blocks=max(counts) * blocks_for(1024)))}
    print(f"{'streams':>7} {'method':>7} {'k':>3} {'equal':>9} {'max |dlogprob|':>15}")
    # products and attention compute a row alike in any pass, so plain at one concurrency is the reference
    # for every other; plain at the others is compared with it too
    reference_at = max(counts)
    print(f"{reference_at} streams, drafts off (the reference) ...", file=sys.stderr, flush=True)
    plain = trio.run(run, model, placement, requests, reference_at, None, 1)
    for n in counts:
        if n != reference_at:
            print(f"{n} streams, drafts off ...", file=sys.stderr, flush=True)
            report(n, "off", 0, trio.run(run, model, placement, requests, n, None, 1), plain)
        for method in args.methods.split(","):
            for most in (int(k) for k in args.tokens.split(",")):
                print(f"{n} streams, {method}, k {most} ...", file=sys.stderr, flush=True)
                report(n, method, most, trio.run(run, model, placement, requests, n, sources[method](), most), plain)


def report(n: int, method: str, most: int, drafted: list[list], plain: list[list]) -> None:
    equal = sum([t for t, _ in d] == [t for t, _ in p] for d, p in zip(drafted, plain))
    worst = max((abs(a[1] - b[1]) for d, p in zip(drafted, plain) for a, b in zip(d, p)), default=0.0)
    print(f"{n:>7} {method:>7} {most:>3} {equal:>4}/{len(plain):<4} {worst:>15.2e}", flush=True)

if __name__ == "__main__":
    main()
