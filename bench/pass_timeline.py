"""Where a pass's wall time goes in the engine on the GPU: the event loop's work, the runner's thread and
the device, stamped on one clock.

    python bench/pass_timeline.py [--streams 1,64] [--prompt 128] [--new 128]

Runs bench/gpu.py's model and engine (CUDA graphs, fed passes) with the lane core's and the backend's
steps wrapped in timers, and CUDA events (timed, mapped onto the host clock) around every pass launched.
Over the decode passes (the middle of the run) it prints, a pass: the wall time, the device busy and idle,
the event loop's CPU time, and each stamped step's mean time: settling a pass (apply, detokenize,
deliver), the boundary, planning the fed pass, the launch (staging the inputs, the graph's replay), the wait for the device in a thread,
how late the read-back begins after the device is done, and the read-back.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
import trio

from gpu import load_bench_model, run_engine, say  # bench/gpu.py, run from bench/
from lanes.core import torch_backend
from lanes.core.lane_core import LaneCore
from lanes.backend.torch_backend import TorchBackend
from lanes.gpu.device import runner_for
from lanes.gpu.graphs import DecodeGraphs
from lanes.heap import freeze_startup_heap

STAMPS: list[tuple[str, float, float]] = []  # (step, start, end) on the host clock
EVENTS: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # each launched pass's start and end on the device
WOKE: list[tuple[torch.cuda.Event, float]] = []  # a pass's end on the device, when its read-back began


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            STAMPS.append((name, start, time.perf_counter()))

    return wrapper


def instrument() -> None:
    LaneCore._settle = timed("settle", LaneCore._settle)
    LaneCore._boundary = timed("boundary", LaneCore._boundary)
    LaneCore._fed_after = timed("plan fed", LaneCore._fed_after)
    TorchBackend._launch_step = timed("launch", TorchBackend._launch_step)
    DecodeGraphs.stage = timed("  stage inputs", DecodeGraphs.stage)
    torch.cuda.CUDAGraph.replay = timed("  graph replay", torch.cuda.CUDAGraph.replay)
    launch = TorchBackend.launch

    def launch_timed(self, plan):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        pending = launch(self, plan)
        end.record()
        EVENTS.append((begin, end))
        pending.gpu_end = end
        return pending

    TorchBackend.launch = launch_timed
    Pending = torch_backend._Pending
    Pending.wait = timed("wait (thread)", Pending.wait)
    read = timed("read", Pending.read)

    def read_timed(self):
        if getattr(self, "gpu_end", None) is not None:
            WOKE.append((self.gpu_end, time.perf_counter()))  # how late the read began: mapped after the run
        return read(self)

    Pending.read = read_timed


def launch_on_thread(on: bool) -> None:
    """With `on`, replays are launched from the runner's thread too (as before passes were polled)."""
    if not hasattr(TorchBackend, "_polled"):
        TorchBackend._polled = TorchBackend._replays
    TorchBackend._replays = (lambda self, plan: False) if on else TorchBackend._polled


_BASE: list = []  # (device event, host time at which it completed)


def calibrate() -> None:
    event = torch.cuda.Event(enable_timing=True)
    before = time.perf_counter()
    event.record()
    event.synchronize()
    _BASE[:] = [event, (before + time.perf_counter()) / 2]


def _host_time(event) -> float:
    base, at = _BASE
    return at + base.elapsed_time(event) / 1e3


def report(label: str, rate: float, began: float, ended: float, cpu_per_pass: float) -> None:
    torch.cuda.synchronize()
    span = ended - began
    lo, hi = began + 0.3 * span, began + 0.9 * span  # decode passes: past the prompts, before streams end
    passes = [(_host_time(a), _host_time(b)) for a, b in EVENTS]
    window = [(a, b) for a, b in passes if lo <= a and b <= hi]
    if len(window) < 2:
        say(f"{label}: too few passes in the window")
        return
    wall = (window[-1][1] - window[0][0]) / len(window)
    busy = statistics.mean(b - a for a, b in window)
    steps = defaultdict(list)
    steps["read begins late"] = [woke - _host_time(end) for end, woke in WOKE if lo <= woke <= hi]
    for name, a, b in STAMPS:
        if lo <= a and b <= hi:
            steps[name].append(b - a)
    print(f"\n{label}: {rate:.0f} tok/s; {len(window)} decode passes in the window")
    print(f"{'a pass':<22} {'ms':>7} {'calls':>6}")
    print(f"{'wall':<22} {wall * 1e3:>7.3f}")
    print(f"{'device busy':<22} {busy * 1e3:>7.3f}")
    print(f"{'device idle':<22} {(wall - busy) * 1e3:>7.3f}")
    print(f"{'event loop CPU':<22} {cpu_per_pass * 1e3:>7.3f}")
    for name, times in steps.items():
        print(f"{name:<22} {statistics.mean(times) * 1e3:>7.3f} {len(times) / len(window):>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,64")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--switch", default="", help="GIL switch intervals to try besides the default, in ms")
    parser.add_argument("--thread-launch", action="store_true", help="also launch replays from the runner's thread")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    most = max(counts)
    instrument()
    with tempfile.TemporaryDirectory() as tmp:
        _, model, prompts = load_bench_model(Path(tmp), most, args.prompt, args.new)
        backend = TorchBackend(model, runner_for(model.placement), lanes=most, max_model_len=args.prompt + args.new + 16)
        freeze_startup_heap()  # as `lanes serve` does once start-up is over
        trio.run(run_engine, backend, model, prompts[:2], 4)  # warm-up
        default = sys.getswitchinterval()
        variants = [(None, False)] + [(float(s) / 1e3, False) for s in args.switch.split(",") if s]
        variants += [(None, True)] if args.thread_launch else []
        for switch, on_thread in variants:
            sys.setswitchinterval(default if switch is None else switch)
            launch_on_thread(on_thread)
            for n in counts:
                STAMPS.clear()
                EVENTS.clear()
                WOKE.clear()
                calibrate()
                loop_thread = threading.get_ident()
                cpu = time.thread_time()
                began = time.perf_counter()
                rate, _ = trio.run(run_engine, backend, model, prompts[:n], args.new)
                ended = time.perf_counter()
                assert threading.get_ident() == loop_thread
                cpu_per_pass = (time.thread_time() - cpu) / max(1, len(EVENTS))
                where = "the runner's thread" if on_thread else "the event loop, polled"
                report(f"{n} streams, GIL switch {sys.getswitchinterval() * 1e3:g} ms, launched on {where}",
                       rate, began, ended, cpu_per_pass)
        sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
