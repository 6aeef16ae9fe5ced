"""The lane core's own cost a pass: passes one after another, the pass ahead, and fed passes
(docs/DECISIONS.md), in one run.

    python bench/lane_core.py [--pass-ms 2] [--streams 1,16,64] [--new 128] [--runs 3] [--modes "fed,fed polled"]

The backend is a stand-in for a device with a queue: each pass it is handed takes `--pass-ms` after the
one before it ends, and its result is waited for in the runner's worker thread (as a thread waiting for
the GPU does) or, in the mode "fed polled", polled from the event loop (`gpu/polling.py`, as CUDA graph
replays are); it draws fixed tokens. So what is measured is the lane core around it: planning, applying,
detokenizing (the default model's tokenizer), stop strings, delivering events to one consumer task a
stream. Prints tokens/s and milliseconds a pass for each setting (the median run), the ratios to the
first, and the event loop thread's CPU time a pass (`host ms`): the lane core's own cost, which bounds
the pass once it exceeds the device's.
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
from lanes.backend.torch_backend import text_factory
from lanes.gpu.device import CpuRunner
from lanes.gpu.polling import PassWaiter
from lanes.heap import freeze_startup_heap


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
            return self._result(plan)

        return await self.runner.run(run, started)

    def _result(self, plan) -> PassResult:
        return PassResult(tuple(Sampled((20 + (plan.step * 7 + w.piece.lane) % (self.vocab - 20),)) if w.sample else None
                                for w in plan.work), tuple(None for _ in plan.work))

    def bind(self, *args) -> None:
        pass

    def unbind(self, lane: int) -> None:
        pass

    async def aclose(self) -> None:
        pass


class PolledPass(QueuedPass):
    """The same device, its passes launched from the event loop and their ends polled there."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._waiter, self._limiter = PassWaiter(), trio.CapacityLimiter(1)

    async def step(self, plan, started=None, following=None):
        queued, self._queued = self._queued, None
        end = queued[1] if queued is not None else self._hand_over()
        if following is not None:
            self._queued = following, self._hand_over()
        if started is not None:
            started()
        return await self._waiter.collect(_Ends(end, lambda: self._result(plan)), self._limiter)


class _Ends:
    """A stand-in pass's end, as `PassWaiter` polls it."""

    waits = True

    def __init__(self, end: float, read) -> None:
        self.end, self.read = end, read

    def done(self) -> bool:
        return time.perf_counter() >= self.end

    def wait(self) -> None:
        time.sleep(max(0.0, self.end - time.perf_counter()))


# (run_ahead, feeds, polled)
MODES = {"one by one": (False, False, False), "ahead": (True, False, False), "fed": (True, True, False),
         "fed polled": (True, True, True)}


async def run(tokenizer, streams: int, new: int, seconds: float, mode: str) -> tuple[float, float, float]:
    ahead, feeds, polled = MODES[mode]
    backend = (PolledPass if polled else QueuedPass)(seconds, max(streams, 1), tokenizer.vocab_size, feeds)
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
    parser.add_argument("--runs", type=int, default=3, help="runs of each setting, interleaved; the median is shown")
    parser.add_argument("--modes", default=",".join(MODES), help="which modes, by name, comma-separated")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",")]
    tokenizer = open_checkpoint(resolve_model(DEFAULT_MODEL)).tokenizer()  # the default model's, a real BPE
    freeze_startup_heap()  # as `lanes serve` does
    rows = []
    for n in [int(s) for s in args.streams.split(",")]:
        runs = {mode: [] for mode in modes}
        for i in range(args.runs):  # interleaved, so that the machine's slow spells fall on every mode
            for mode in modes:
                print(f"{n} streams, {mode}, run {i + 1} ...", file=sys.stderr, flush=True)
                runs[mode].append(trio.run(run, tokenizer, n, args.new, args.pass_ms / 1e3, mode))
        rows.append((n, {mode: sorted(r)[len(r) // 2] for mode, r in runs.items()}))  # the median run, by tok/s
    print(f"\nlane core around a {args.pass_ms:g} ms pass (a stand-in device queue), {args.new} tokens a stream, "
          f"median of {args.runs}")
    print(f"{'streams':>7} {'mode':>11} {'tok/s':>8} {'ms/pass':>8} {'x first':>8} {'host ms':>8}")
    for n, median in rows:
        first = next(iter(median.values()))[0]
        for mode, (rate, per_pass, host) in median.items():
            print(f"{n:>7} {mode:>11} {rate:>8.0f} {per_pass * 1e3:>8.2f} {rate / first:>8.2f} {host * 1e3:>8.2f}")

if __name__ == "__main__":
    main()
