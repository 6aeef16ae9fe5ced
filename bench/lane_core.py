"""The lane core's own cost a pass: passes one after another, the pass ahead, and fed passes
(docs/DECISIONS.md), in one run.

    python bench/lane_core.py [--pass-ms 2] [--streams 1,16,64] [--new 128]

The backend is a stand-in for a device with a queue: each pass it is handed takes `--pass-ms` after the
one before it ends, and its result is waited for in the runner's worker thread (as a thread waiting for
the GPU does); it draws fixed tokens. So what is measured is the lane core around it: planning, applying,
detokenizing (the default model's tokenizer), stop strings, delivering events to one consumer task a
stream. Prints tokens/s and milliseconds a pass for each setting, the ratios to the first, and the event
loop thread's CPU time a pass (`host ms`): the lane core's own cost, which bounds the pass once it exceeds
the device's.
"""

from __future__ import annotations

import argparse
import sys
import time

import trio

from lanes.core.backend import BackendShape
from lanes.core.lane_core import LaneCore
from lanes.core.plan import PassResult, Sampled
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Request
from lanes.core.torch_backend import text_factory
from lanes.gpu.device import CpuRunner


class QueuedPass:
    """A stand-in device: passes run one after another, each `seconds` long from when it is handed over or
    the one before ends; a step waits for its pass's end in the worker thread. Tokens depend on the lane
    and the step. With `feeds`, a following pass is queued before the step waits."""

    def __init__(self, seconds: float, lanes: int, vocab: int, feeds: bool) -> None:
        self.seconds, self.runner, self.passes, self.vocab = seconds, CpuRunner(), 0, vocab
        self.shape = BackendShape(lanes, lanes * 20, 16, vocab, 1024, feeds=feeds)
        self._free_at = 0.0  # when the device is done with everything handed to it
        self._queued = None  # (plan, end time) of a following pass

    def _hand_over(self) -> float:
        self.passes += 1
        self._free_at = max(time.perf_counter(), self._free_at) + self.seconds
        return self._free_at

    async def step(self, plan, started=None, following=None):
        def run():
            queued, self._queued = self._queued, None
            end = queued[1] if queued is not None else self._hand_over()
            if following is not None:
                self._queued = following, self._hand_over()
            time.sleep(max(0.0, end - time.perf_counter()))
            return PassResult(tuple(Sampled(20 + (plan.step * 7 + w.piece.lane) % (self.vocab - 20)) if w.sample else None
                                    for w in plan.work), tuple(None for _ in plan.work))

        return await self.runner.run(run, started)

    def bind(self, *args) -> None:
        pass

    def unbind(self, lane: int) -> None:
        pass

    async def aclose(self) -> None:
        pass


MODES = {"one by one": (False, False), "ahead": (True, False), "fed": (True, True)}  # (run_ahead, feeds)


async def run(tokenizer, streams: int, new: int, seconds: float, mode: str) -> tuple[float, float, float]:
    ahead, feeds = MODES[mode]
    backend = QueuedPass(seconds, max(streams, 1), tokenizer.vocab_size, feeds)
    core = LaneCore(backend, text_factory(tokenizer), [], max_rows=4096, max_queue=1024, run_ahead=ahead)
    sampling = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)

    async def one(i: int) -> None:
        stream = await core.submit(Request(tuple(range(30, 158)), sampling))
        async for _ in stream.events:
            pass

    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        began, cpu = time.perf_counter(), time.thread_time()  # this thread's: the event loop's
        async with trio.open_nursery() as clients:
            for i in range(streams):
                clients.start_soon(one, i)
        took, cpu = time.perf_counter() - began, time.thread_time() - cpu
        await core.shutdown(0)
    core.check_integrity()
    return streams * new / took, took / backend.passes, cpu / backend.passes


def main() -> None:
    from lanes.loader import open_checkpoint
    from lanes.models import DEFAULT_MODEL, resolve_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pass-ms", type=float, default=2.0)
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    tokenizer = open_checkpoint(resolve_model(DEFAULT_MODEL)).tokenizer()  # the default model's, a real BPE
    rows = []
    for n in [int(s) for s in args.streams.split(",")]:
        best = {}
        for mode in MODES:
            print(f"{n} streams, {mode} ...", file=sys.stderr, flush=True)
            runs = [trio.run(run, tokenizer, n, args.new, args.pass_ms / 1e3, mode) for _ in range(3)]
            best[mode] = max(runs)  # the best of three: the least disturbed by the rest of the machine
        rows.append((n, best))
    print(f"\nlane core around a {args.pass_ms:g} ms pass (a stand-in device queue), {args.new} tokens a stream")
    print(f"{'streams':>7} {'mode':>11} {'tok/s':>8} {'ms/pass':>8} {'x one by one':>13} {'host ms':>8}")
    for n, best in rows:
        for mode, (rate, per_pass, host) in best.items():
            print(f"{n:>7} {mode:>11} {rate:>8.0f} {per_pass * 1e3:>8.2f} {rate / best['one by one'][0]:>13.2f}"
                  f" {host * 1e3:>8.2f}")


if __name__ == "__main__":
    main()
