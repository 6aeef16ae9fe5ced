"""On the GPU, speculative drafts off and on in one run: decode tokens/s at 1, 16 and 64 streams on the
input-grounded and open-ended workloads, drafted rows verified inside the captured graphs.

    python bench/gpu.py --drafts ngram[,suffix] [--model M] [--streams 1,16,64] [--new 128] [--repeats 3]
                        [--draft-tokens 8]

The model (default: the default model, from $LANES_HOME) in bf16 on CUDA; the workloads of bench/drafts.py
(chat prompts, greedy, `max_tokens` --new). At N streams, N requests at once, cycled from the workload's
prompts (at 1 stream, 4 one after another). Decode tokens/s counts each stream's tokens after its first,
over the time from the first stream's first token to the last one's last; draft lengths follow the lane
core's load control, as `lanes serve --draft` runs them; each run's lane core first serves N requests of the
other workload, untimed (bench/drafts.py's warm-up). Each stream count's backend is built once (graphs
captured with logit rows for --draft-tokens drafted rows a lane) and runs every setting, off and each
method in turn, --repeats times; the median run is shown. Prints one table: tokens/s off, each method's
tokens/s, its ratio to off, its mean accepted tokens a drafted piece, and the share of its drafted passes
that ran as graph replays.
"""

from __future__ import annotations

import gc
import statistics
import sys

import torch
import trio

from drafts import decode_rate as drafts_decode_rate
from drafts import workloads
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.core.backend import BackendWrapper
from lanes.core.blocks import blocks_for
from lanes.core.lane_core import LaneCore
from lanes.drafts.ngram import NgramDrafter
from lanes.drafts.suffix import SuffixDrafter
from lanes.gpu.device import choose, runner_for
from lanes.heap import freeze_startup_heap
from lanes.loader import load_model
from lanes.models import resolve_model

SOURCES = {"ngram": NgramDrafter, "suffix": SuffixDrafter}
CONTEXT = 1024


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Counted(BackendWrapper):
    """Counts the passes that carry drafts (the graphs count those they replayed)."""

    drafted = 0

    async def step(self, plan, started=None, following=None):
        self.drafted += plan.drafted > 0
        return await self.inner.step(plan, started, following)


async def decode_rate(backend: Counted, model, prompts, warm, at_once: int, new: int, drafts, most: int):
    """(decode tokens/s, mean accepted length or None, share of drafted passes replayed in graphs or None)."""
    core = LaneCore(backend, text_factory(model.tokenizer), model.tokenizer.eos_ids, max_rows=512, drafts=drafts,
                    draft_tokens=most)
    graphs = backend.inner.graphs  # None without CUDA: nothing is replayed
    replayed, counted = graphs.passes["drafted"] if graphs else 0, backend.drafted
    rate, stats = await drafts_decode_rate(core, prompts, warm, at_once, new)
    drafted = backend.drafted - counted
    graphed = (graphs.passes["drafted"] - replayed) / drafted if drafted and graphs else None
    return rate, stats.mean_accepted if stats is not None else None, graphed


def main_drafts(args) -> None:
    counts = [int(n) for n in args.streams.split(",")]
    methods = [m.strip() for m in args.drafts.split(",") if m.strip()]
    unknown = [m for m in methods if m not in SOURCES]
    if unknown:
        raise SystemExit(f"--drafts takes {', '.join(SOURCES)}, not {', '.join(unknown)}")
    placement = choose("cuda", "bf16")
    say("loading the model ...")
    model = load_model(resolve_model(args.model), placement, kv_blocks=max(counts) * blocks_for(CONTEXT) + 16)
    texts = {name: [model.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in prompts]
             for name, prompts in workloads().items()}
    rows = []
    for n in counts:
        say(f"{n} streams: capturing graphs with room for {args.draft_tokens} draft tokens a lane ...")
        backend = Counted(TorchBackend(model, runner_for(placement), lanes=n, max_model_len=CONTEXT,
                                       draft_tokens=args.draft_tokens))
        freeze_startup_heap()
        trio.run(decode_rate, backend, model, texts["open-ended"][:2], (), 2, 8, None, args.draft_tokens)  # warm-up
        for name, prompts in texts.items():
            batch = prompts[:4] if n == 1 else [prompts[i % len(prompts)] for i in range(n)]
            other = next(p for w, p in texts.items() if w != name)
            warm = [other[i % len(other)] for i in range(n)]
            runs: dict[str, list] = {"off": [], **{m: [] for m in methods}}
            for i in range(args.repeats):  # in turn, so that the host's slow spells fall on every setting
                for method in runs:
                    say(f"  {name}, {method}, run {i + 1} ...")
                    drafts = SOURCES[method]() if method != "off" else None
                    runs[method].append(trio.run(decode_rate, backend, model, batch, warm, n, args.new, drafts,
                                                 args.draft_tokens))
            rows.append((name, n, {m: sorted(r, key=lambda x: x[0])[len(r) // 2] for m, r in runs.items()},
                         {m: [x[0] for x in r] for m, r in runs.items()}))
            say("  " + ", ".join(f"{m} {statistics.median(v):.0f}" for m, v in rows[-1][3].items()))
        del backend
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\ndrafts on CUDA ({args.model}, bf16, graphs), {torch.cuda.get_device_name()}, greedy, "
          f"{args.new} new tokens at most a request, draft tokens {args.draft_tokens}, median of {args.repeats}")
    head = f"{'workload':>15} {'streams':>7} {'off tok/s':>9}"
    for method in methods:
        head += f" {method + ' tok/s':>12} {'x off':>6} {'accepted':>8} {'graphed':>7}"
    print(head)
    for name, n, result, _ in rows:
        off = result["off"][0]
        line = f"{name:>15} {n:>7} {off:>9.0f}"
        for method in methods:
            rate, accepted, graphed = result[method]
            line += (f" {rate:>12.0f} {rate / off:>6.2f} {accepted if accepted is not None else float('nan'):>8.2f}"
                     f" {graphed if graphed is not None else float('nan'):>7.0%}")
        print(line)
