"""Decision latency with the engine idle and under live streams, beside an idle-only policy, in one run.

    python bench/decisions.py [--model M] [--decisions 8] [--device cpu]

Each decision asks 3 questions (predicate, choice, score) about a ~150-token input. Live load: N clients
that each stream 48 tokens, pause 0.2 s and start again. Policies: ours (decisions take free lanes beside
live streams) and idle-only (decisions run only when no stream is live). Prints p50 and p95 latency for
each policy with 0, 4 and 8 live clients, and the ratio to the idle latency. A decision gets `--deadline`
seconds (30); one that runs out is counted at its deadline, so a p50 or p95 shown as ">=" is censored.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import trio

from lanes.core.decider import DecisionRequest, DecisionTimeout
from lanes.core.lane_core import LaneCore
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Request
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import choose, runner_for
from lanes.http.decision_prompts import Option, Question, find_label_tokens, render
from lanes.loader import load_model
from lanes.models import resolve_model

STATE = ("Order 4471: two crates of apples shipped on Monday, one crate arrived bruised, the customer asked for a "
         "refund of the damaged crate only and praised the driver. ") * 4
QUESTIONS = [
    Question("predicate", "Did the customer ask for a refund?", (Option("true"), Option("false"))),
    Question("choice", "Which item was damaged?", (Option("apples"), Option("pears"), Option("nothing"))),
    Question("score", "How satisfied is the customer?", (Option("angry"), Option("neutral"), Option("happy"))),
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def measure(model, placement, clients: int, idle_only: bool, decisions: int, deadline: float) -> list[float]:
    backend = TorchBackend(model, runner_for(placement), lanes=12, max_model_len=2048)
    core = LaneCore(backend, text_factory(model.tokenizer), model.tokenizer.eos_ids, max_rows=256,
                    decisions_idle_only=idle_only)
    labels = find_label_tokens(model.tokenizer)
    prompts = tuple(tuple(render(model.tokenizer, None, STATE, q)) for q in QUESTIONS)
    request = DecisionRequest(prompts, tuple(tuple(labels[q.kind][x] for x in q.labels) for q in QUESTIONS))
    live_prompt = tuple(model.tokenizer.encode("Write a long story about the sea and the ships that sail on it."))
    latencies = []

    async def live_client():
        while True:
            stream = await core.submit(Request(live_prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=48)))
            async for _ in stream.events:
                pass
            await trio.sleep(0.2)

    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        for _ in range(clients):
            nursery.start_soon(live_client)
        if not clients:
            await core.decide(request)  # warm-up
        for _ in range(decisions):
            start = time.perf_counter()
            timed = DecisionRequest(request.prompts, request.labels, trio.current_time() + deadline)
            try:
                await core.decide(timed)
                latencies.append(time.perf_counter() - start)
            except DecisionTimeout:
                latencies.append(deadline)
            print(f"  {latencies[-1] * 1e3:.0f} ms", file=sys.stderr)
        nursery.cancel_scope.cancel()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--decisions", type=int, default=6)
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    placement = choose(args.device, args.dtype)
    path = resolve_model(args.model)
    model = load_model(path, placement, kv_blocks=12 * 128)
    rows = []
    for policy, idle_only in (("beside live streams", False), ("idle only", True)):
        for clients in (0, 4, 8):
            print(f"{policy}, {clients} live clients ...", file=sys.stderr)
            latencies = trio.run(measure, model, placement, clients, idle_only, args.decisions, args.deadline)
            rows.append((policy, clients, statistics.median(latencies), percentile(latencies, 0.95)))
    censored = args.deadline
    idle = {policy: p50 for policy, clients, p50, _ in rows if clients == 0}
    print(f"\nmodel {path.name} on {placement.describe()}; 3 questions over a {len(STATE.split())}-word input; "
          f"live clients stream 48 tokens, pause 0.2 s, repeat")
    print(f"{'policy':<20} {'live':>5} {'p50 ms':>9} {'p95 ms':>9} {'p50 / idle':>11}")
    def ms(seconds: float) -> str:
        return f">={seconds * 1e3:.0f}" if seconds >= censored else f"{seconds * 1e3:.0f}"

    for policy, clients, p50, p95 in rows:
        print(f"{policy:<20} {clients:>5} {ms(p50):>9} {ms(p95):>9} {p50 / idle[policy]:>11.2f}")


if __name__ == "__main__":
    main()
