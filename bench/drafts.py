"""Speculative drafts on the CPU: decode tokens/s with drafts off and on, in one run, at 1, 8 and 32 streams.

    python bench/drafts.py [--model M] [--streams 1,8,32] [--new 128] [--methods ngram,suffix] [--draft-tokens 16]
                           [--runs 1] [--dequantize] [--workloads input-grounded,open-ended]

Two fixed workloads of 32 chat requests each to the default model, greedy: `input-grounded` (repeat, quote
or copy a given passage, where the answer repeats its input) and `open-ended` (stories and explanations).
At N streams all 32 requests run, N at a time (at 1 stream one after another), so every row does the same
work. Each setting (off, each method) has a lane core and a model of its own, and the settings take each N
requests in turn (at 1 stream, request by request): this host's slow spells, which last seconds and
change plain decoding's rate by a third, fall on every setting alike. Decode tokens/s counts each stream's tokens after its first, over the time when some stream was
decoding (the union of the streams' first-to-last-token spans: at 1 stream the next request's prompt pass is
not decode time); drafts are sized by the lane core's load control, as `lanes serve --draft ngram` runs
them on the CPU, up to 16 tokens a lane (on a 2-core CPU, the default model's fp32 products of 9 rows cost
about 1.3x one row's, of 16 rows about 1.75x: load control drafts that long only while it pays).
Each lane core first serves, untimed, N requests of the other workload (32 new tokens each), as a
server that has been up a while has: its load control has timed its passes, its suffix index holds outputs.
Prints one table: tokens/s off, each method's tokens/s, its ratio to off, and its mean accepted draft tokens
a drafted piece. `--dequantize` reads the GGUF file's blocks as fp32 tensors: the full-precision regime,
whose passes read 4-8x the weight bytes a row.
"""

from __future__ import annotations

import argparse
import sys
import time

import trio

from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.core.blocks import blocks_for
from lanes.core.drafting import DraftStats
from lanes.core.lane_core import LaneCore
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Finished, Request, TokenEvent
from lanes.drafts.ngram import NgramDrafter
from lanes.drafts.suffix import SuffixDrafter
from lanes.gpu.device import choose, runner_for
from lanes.loader import load_model
from lanes.models import DEFAULT_MODEL, resolve_model

PASSAGES = [
    "The river runs through the old town, past the market and the stone bridge, and on to the sea. In spring the "
    "water rises and the fishermen mend their nets on the bank while children watch the boats come in.",
    "To reset the router, unplug it from the wall, wait thirty seconds, and plug it back in. When the front light "
    "turns green, open the settings page and sign in with the password printed on the label underneath.",
    "The committee met on Tuesday to review the budget. It agreed to fund the new library wing, delayed the road "
    "repairs until the autumn, and asked the treasurer to report again at the next meeting in March.",
    "Bees visit thousands of flowers in a single day. They carry pollen from one plant to the next, and in doing "
    "so they help fruit and seeds to form. Without them, many crops would give far smaller harvests.",
    "def total(items):\n    result = 0\n    for item in items:\n        result = result + item.price * item.count\n"
    "    return result\n\n\ndef average(items):\n    return total(items) / len(items)\n",
    "Mix the flour and the salt in a large bowl. Add the warm water slowly, stirring all the time, until the dough "
    "comes together. Knead it for ten minutes, then leave it covered in a warm place for an hour.",
    "The train to the coast leaves platform four at nine in the morning and stops at every station along the "
    "valley. Tickets can be bought on board, but seats are not reserved, so it is best to arrive early.",
    "Our office will be closed on Monday for the holiday. Orders placed over the weekend will be shipped on "
    "Tuesday, and our support team will answer every message in the order it arrived.",
]
ASKS = ["Repeat the following text exactly, word for word:\n\n{}", "Copy this text:\n\n{}",
        "Here is a text:\n{}\nQuote the whole text back to me.", "Please write out this text again, unchanged:\n\n{}"]
TOPICS = ["a cat who learns to sail", "why the sky is blue", "a robot that paints", "how bread rises",
          "a journey across the desert", "the life of a lighthouse keeper", "how rainbows form", "a lost key",
          "the first day at a new school", "why leaves change colour", "a dragon who is afraid of fire",
          "how a bicycle works", "a storm at sea", "the moon landing", "a garden in winter", "a talking tree"]
OPEN = ["Write a short story about {}.", "Explain {} to a child."]


def workloads() -> dict[str, list[str]]:
    grounded = [ask.format(passage) for passage in PASSAGES for ask in ASKS]
    open_ended = [form.format(topic) for topic in TOPICS for form in OPEN]
    return {"input-grounded": grounded, "open-ended": open_ended}


WARM_NEW = 32  # new tokens a warm-up request


class Tally:
    """Decode tokens of the timed requests (each stream's after its first) and their first-to-last-token spans."""

    def __init__(self) -> None:
        self.tokens, self.spans = 0, []

    def rate(self) -> float:
        return self.tokens / covered(self.spans)


async def request(core: LaneCore, prompt, most: int, tally: Tally | None) -> None:
    """One greedy request through `core`, counted in `tally` when it is timed."""
    stream = await core.submit(Request(tuple(prompt), SamplingParams(temperature=0, max_tokens=most)))
    first = None
    async for event in stream.events:
        if isinstance(event, TokenEvent) and first is None:
            first = time.perf_counter()
        elif isinstance(event, Finished) and tally is not None:
            tally.tokens += event.completion_tokens - 1
            if first is not None:
                tally.spans.append((first, time.perf_counter()))


def report(label: str, rate: float, drafts: DraftStats | None) -> None:
    print(f"    {label}{rate:.1f} tok/s", file=sys.stderr, flush=True)
    if drafts is not None:
        print(f"    passes: {drafts.fresh} fresh, {drafts.ahead} ahead; {drafts.pieces} drafted pieces", file=sys.stderr,
              flush=True)


async def decode_rate(core: LaneCore, prompts, warm, at_once: int, new: int) -> tuple[float, DraftStats | None]:
    """Run greedy `warm`, then `prompts` through `core`, `at_once` at a time, then stop it: (decode tokens/s
    of `prompts`, the drafts' statistics over them or None). Decode tokens are each stream's after its
    first, over the time inside some stream's first-to-last-token span."""
    tally, limiter = Tally(), trio.Semaphore(at_once)

    async def one(prompt, most: int, timed: bool) -> None:
        async with limiter:
            await request(core, prompt, most, tally if timed else None)

    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        for batch, most, timed in ((warm, WARM_NEW, False), (prompts, new, True)):
            if timed:
                before = core.statistics().drafts
            async with trio.open_nursery() as clients:
                for prompt in batch:
                    clients.start_soon(one, prompt, most, timed)
        stats = core.statistics()
        await core.shutdown(0)
    core.check_stopped()
    rate, drafts = tally.rate(), stats.drafts and stats.drafts.since(before)
    report("", rate, drafts)
    return rate, drafts


async def paired_rates(cores: dict[str, LaneCore], prompts, warm, at_once: int, new: int) -> dict[str, tuple[float, DraftStats | None]]:
    """Decode tokens/s of each setting's lane core over the same `prompts`, `at_once` at a time, the cores
    taking each group of `at_once` in turn (at 1 stream: request by request), so that the host's slow spells,
    which last seconds, fall on every setting alike; each core first serves `warm`, untimed. Each core
    has a model of its own (the KV cache is the model's)."""
    tallies = {name: Tally() for name in cores}
    async with trio.open_nursery() as nursery:
        for core in cores.values():
            await nursery.start(core.run)
        for core in cores.values():
            async with trio.open_nursery() as clients:
                for prompt in warm:
                    clients.start_soon(request, core, prompt, WARM_NEW, None)
        before = {name: core.statistics().drafts for name, core in cores.items()}
        for start in range(0, len(prompts), at_once):
            for name, core in cores.items():
                async with trio.open_nursery() as clients:
                    for prompt in prompts[start:start + at_once]:
                        clients.start_soon(request, core, prompt, new, tallies[name])
        results = {}
        for name, core in cores.items():
            drafts = core.statistics().drafts
            results[name] = (tallies[name].rate(), drafts and drafts.since(before[name]))
            await core.shutdown(0)
    for name, core in cores.items():
        core.check_stopped()
        report(f"{name}: ", *results[name])
    return results


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds inside at least one of the spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--draft-tokens", type=int, default=16, help="a lane's most draft tokens a pass")
    parser.add_argument("--runs", type=int, default=1, help="runs of each setting, interleaved; the median is shown")
    parser.add_argument("--dequantize", action="store_true", help="the GGUF blocks read as fp32 tensors")
    parser.add_argument("--workloads", default="input-grounded,open-ended", help="which of the two to run")
    args = parser.parse_args()
    placement = choose("cpu", "fp32")
    counts = [int(n) for n in args.streams.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    models = {name: load_model(resolve_model(args.model), placement, kv_blocks=max(counts) * blocks_for(1024),
                               dequantize=args.dequantize) for name in ("off", *methods)}  # a KV cache each
    model = models["off"]
    sources = {"ngram": NgramDrafter, "suffix": SuffixDrafter}
    rows = []
    encoded = {name: [model.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]
               for name, texts in workloads().items()}
    for name, prompts in encoded.items():
        if name not in args.workloads.split(","):
            continue
        other = next(p for w, p in encoded.items() if w != name)
        for n in counts:
            results: dict[str, list] = {"off": [], **{m: [] for m in methods}}
            for i in range(args.runs):  # each run's settings take the requests in turn (`paired_rates`)
                print(f"{name}, {n} streams, run {i + 1} ...", file=sys.stderr, flush=True)
                cores = {method: LaneCore(TorchBackend(models[method], runner_for(placement), lanes=n, max_model_len=1024),
                                          text_factory(model.tokenizer), model.tokenizer.eos_ids, max_rows=512,
                                          drafts=sources[method]() if method != "off" else None,
                                          draft_tokens=args.draft_tokens)
                         for method in results}
                for method, result in trio.run(paired_rates, cores, prompts, other[:n], n, args.new).items():
                    results[method].append(result)
            rows.append((name, n, {m: sorted(r, key=lambda x: x[0])[len(r) // 2] for m, r in results.items()}))
    kinds = ", ".join(sorted(model.weights_census().tensors))
    products = "fp32 products" if args.dequantize else "Q8_0/Q4_0/Q4_1 products on 8-bit activations"
    print(f"\ndrafts on the CPU ({args.model}: {kinds}; {products}), greedy, {args.new} new tokens a request, "
          f"at most {args.draft_tokens} draft tokens a lane, median of {args.runs}")
    head = f"{'workload':>15} {'streams':>7} {'off tok/s':>9}"
    for method in methods:
        head += f" {method + ' tok/s':>12} {'x off':>6} {'accepted':>8}"
    print(head)
    for name, n, result in rows:
        off = result["off"][0]
        line = f"{name:>15} {n:>7} {off:>9.1f}"
        for method in methods:
            rate, stats = result[method]
            line += f" {rate:>12.1f} {rate / off:>6.2f} {stats.mean_accepted:>8.2f}"
        print(line)


if __name__ == "__main__":
    main()
