"""Where a decode step's GPU time goes: the fast decode step under torch.profiler, kernels grouped.

    python bench/profile_decode.py [--lanes 1,64] [--context 192]

Builds the Qwen2.5-0.5B-shaped model of bench/gpu.py, fills `--lanes` lanes to `--context` tokens, runs
the fast decode step 20 times under the profiler (outside a graph, so kernels keep their names) and prints
each kernel family's GPU microseconds a step, beside the whole step replayed as a CUDA graph.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpu import build  # bench/gpu.py, run from bench/
from lanes.core.blocks import BlockPool, BlockTable, blocks_for
from lanes.gpu.device import choose
from lanes.gpu.graphs import DecodeGraphs
from lanes.core.passes import Piece
from lanes.loader import load_model


def family(name: str) -> str:
    for key in ("paged_decode", "add_rms_norm", "rope_write", "silu_mul", "gemv", "gemm", "Kernel2", "sm90", "cutlass",
                "embedding", "index", "copy", "elementwise", "reduce", "cat"):
        if key.lower() in name.lower():
            return key
    return name[:40]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lanes", default="1,64")
    parser.add_argument("--context", type=int, default=192)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        counts = [int(n) for n in args.lanes.split(",")]
        model = load_model(Path(tmp), choose("cuda", "bf16"), kv_blocks=max(counts) * blocks_for(args.context + 2) + 8)
    decoder = model.decoder
    graphs = DecodeGraphs(decoder, max(counts), args.context + 16)
    graphs.capture()
    for lanes in counts:
        pool = BlockPool(model.kv_blocks)
        tables = [BlockTable(("lane", i)) for i in range(lanes)]
        for t in tables:
            t.reserve(pool, args.context + 1)
        pieces = [Piece(i, (7,), args.context, tuple(t.blocks)) for i, t in enumerate(tables)]
        graphs.stage(pieces, lanes)
        inputs = graphs._views(lanes)
        for _ in range(3):
            decoder.decode_step(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                decoder.decode_step(*inputs)
            torch.cuda.synchronize()
        per_family = defaultdict(float)
        launches = defaultdict(int)
        for event in prof.key_averages():
            if event.device_type.name == "CUDA" or getattr(event, "self_device_time_total", 0):
                us = getattr(event, "self_device_time_total", 0) / 20
                if us > 0:
                    per_family[family(event.key)] += us
                    launches[family(event.key)] += event.count // 20
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs.run(pieces)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        total = sum(per_family.values())
        print(f"\n{lanes} lanes at {args.context} tokens: kernels {total:.0f} us a step (sum of GPU time), "
              f"graph replay {statistics.median(times):.0f} us")
        print(f"{'kernel family':<42} {'us a step':>10} {'launches':>9} {'share':>6}")
        for name, us in sorted(per_family.items(), key=lambda kv: -kv[1])[:14]:
            print(f"{name:<42} {us:>10.1f} {launches[name]:>9} {us / total:>6.0%}")
        for t in tables:
            t.clear(pool)


if __name__ == "__main__":
    main()
