"""A decode pass's time by its rows on the CPU: what load control's cost model (`core.pass_cost`) learns.

    python bench/pass_rows.py [--model M] [--drafts 0,4,8,12,16] [--rounds 4] [--prompts 3] [--new 96] [--dequantize]

One stream decodes `--prompts` input-grounded requests greedily, drafting exactly k tokens every pass (a
source that proposes k copies of the stream's last token, load control off, so nearly every draft fails and
each pass has 1 + k rows, fewer only at a request's end); each k in turn, `--rounds` times, interleaved.
Prints the median over rounds of a run's mean pass time at each row count beside the one-row pass's
(k = 0), and the line with a knee that `PassCost` fits to them.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import trio

from drafts import decode_rate, workloads
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.core.blocks import blocks_for
from lanes.core.lane_core import LaneCore
from lanes.core.pass_cost import PassCost
from lanes.gpu.device import choose, runner_for
from lanes.loader import load_model
from lanes.models import DEFAULT_MODEL, resolve_model


class Repeat:
    """k copies of the stream's last token: a draft of fixed length, kept only where the text repeats."""

    def propose(self, job, most: int) -> tuple[int, ...]:
        return (job.generated[-1] if job.generated else job.prompt[-1],) * most

    def forget(self, job) -> None:
        pass


async def pass_time(model, placement, prompts, k: int, new: int) -> tuple[float, float]:
    """Mean seconds and rows of the decode passes over `prompts`, one at a time, drafting k tokens a pass."""
    backend = TorchBackend(model, runner_for(placement), lanes=1, max_model_len=1024)
    core = LaneCore(backend, text_factory(model.tokenizer), model.tokenizer.eos_ids, max_rows=512,
                    drafts=Repeat(), draft_tokens=k, draft_control=False)
    _, stats = await decode_rate(core, prompts, [], 1, new)
    passes = stats.fresh.passes + stats.ahead.passes  # k = 0: planned ahead; else afresh, as drafted passes are
    return (stats.fresh.seconds + stats.ahead.seconds) / passes, (stats.fresh.rows + stats.ahead.rows) / passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--drafts", default="0,4,8,12,16", help="draft tokens a pass (rows: one more)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--dequantize", action="store_true", help="the GGUF blocks read as fp32 tensors")
    args = parser.parse_args()
    placement = choose("cpu", "fp32")
    model = load_model(resolve_model(args.model), placement, kv_blocks=2 * blocks_for(1024), dequantize=args.dequantize)
    prompts = [model.tokenizer.encode_chat([{"role": "user", "content": text}])
               for text in workloads()["input-grounded"][:args.prompts]]
    drafts = [int(k) for k in args.drafts.split(",")]
    times: dict[int, list[tuple[float, float]]] = {k: [] for k in drafts}
    for i in range(args.rounds):
        for k in drafts:
            print(f"round {i + 1}, {1 + k} rows ...", file=sys.stderr, flush=True)
            times[k].append(trio.run(pass_time, model, placement, prompts, k, args.new))
    medians = {k: statistics.median(seconds for seconds, _ in times[k]) for k in drafts}
    base = medians[min(drafts)]
    cost = PassCost()
    for k in drafts:
        cost.add(1 + k, medians[k])
    print(f"\ndecode passes of one stream on the CPU ({args.model}, {'fp32 products' if args.dequantize else 'quantized'}),"
          f" median of {args.rounds} interleaved rounds")
    print(f"{'rows':>5} {'mean rows':>9} {'ms a pass':>10} {'x 1 row':>8} {'knee fit ms':>12}")
    for k in drafts:
        rows = statistics.mean(r for _, r in times[k])
        print(f"{1 + k:>5} {rows:>9.2f} {medians[k] * 1e3:>10.2f} {medians[k] / base:>8.3f} {cost.seconds(1 + k) * 1e3:>12.2f}")
    print(f"fit: {cost.fixed * 1e3:.2f} ms, rows up to {cost.free} free, then {cost.per_row * 1e3:.2f} ms a row")


if __name__ == "__main__":
    main()
