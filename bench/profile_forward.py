"""Where the general forward's time goes (prompt passes, and decode without the fast step), host and GPU.

    python bench/profile_forward.py [--prompts 16] [--rows 128]

Builds the Qwen2.5-0.5B-shaped model of bench/gpu.py and runs `Decoder.forward` on (a) one decode row
and (b) `--prompts` prompt pieces of `--rows` tokens, each 10 times under torch.profiler. Prints for each:
the wall time a pass (host clock, synchronised), the GPU time a pass (CUDA events), and the operators
with the most host time and the most GPU time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpu import build  # bench/gpu.py, run from bench/
from lanes.core.passes import Piece
from lanes.core.blocks import BlockPool, BlockTable, blocks_for
from lanes.gpu.device import choose
from lanes.loader import load_model


def timed(decoder, pieces, times: int = 10) -> tuple[float, float]:
    """(wall seconds, GPU seconds) a pass, medians."""
    walls, gpus = [], []
    for _ in range(times):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        decoder.forward(pieces)
        end.record()
        end.synchronize()
        walls.append(time.perf_counter() - began)
        gpus.append(start.elapsed_time(end) / 1e3)
    return statistics.median(walls), statistics.median(gpus)


def report(name: str, decoder, pieces) -> None:
    for _ in range(3):
        decoder.forward(pieces)
    wall, gpu = timed(decoder, pieces)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            decoder.forward(pieces)
        torch.cuda.synchronize()
    print(f"\n{name}: wall {wall * 1e3:.2f} ms a pass, GPU {gpu * 1e3:.2f} ms a pass")
    events = prof.key_averages()
    print(f"{'operator (most host time)':<48} {'host ms':>8} {'calls':>6}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"{e.key[:48]:<48} {e.self_cpu_time_total / 1e4:>8.3f} {e.count // 10:>6}")
    print(f"{'operator (most GPU time)':<48} {'GPU ms':>8} {'calls':>6}")
    for e in sorted(events, key=lambda e: -getattr(e, 'self_device_time_total', 0))[:10]:
        print(f"{e.key[:48]:<48} {getattr(e, 'self_device_time_total', 0) / 1e4:>8.3f} {e.count // 10:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rows", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        model = load_model(Path(tmp), choose("cuda", "bf16"), kv_blocks=args.prompts * blocks_for(args.rows + 2) + 8)
    torch.cuda.empty_cache()
    pool = BlockPool(model.kv_blocks)
    tables = [BlockTable(("lane", i)) for i in range(args.prompts)]
    for t in tables:
        t.reserve(pool, args.rows + 1)
    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(0, 151936, (args.rows,), generator=g).tolist()) for _ in tables]
    with torch.inference_mode():
        report("one decode row at 128 tokens", model.decoder, [Piece(0, (7,), args.rows, tuple(tables[0].blocks))])
        report(f"{args.prompts} prompts of {args.rows} rows", model.decoder,
               [Piece(i, p, 0, tuple(t.blocks)) for i, (p, t) in enumerate(zip(prompts, tables))])
        shapes(model.decoder, tables, prompts, args.rows)


def shapes(decoder, tables, prompts, rows: int) -> None:
    """As the engine runs them: every pass a new shape (a context one longer, prompts of other lengths)."""
    from lanes.gpu import attention

    decode = [[Piece(0, (7,), rows - 16 + i, tuple(tables[0].blocks))] for i in range(16)]
    prefill = [[Piece(i, p[: rows - 16 + j], 0, tuple(t.blocks)) for i, (p, t) in enumerate(zip(prompts, tables))]
               for j in range(16)]
    print(f"\n{'passes of changing shape':<34} {'attention':<34} {'wall ms a pass':>14}")
    for name, old in (("cuDNN allowed, unpadded keys", True), ("efficient/math, keys padded to 64", False)):
        saved = attention.KEY_ALIGN, attention.CUDA_BACKENDS
        if old:
            B = attention.SDPBackend
            attention.KEY_ALIGN, attention.CUDA_BACKENDS = 1, [B.CUDNN_ATTENTION, B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH]
        for case, passes in (("decode, context +1 a pass", decode), ("16 prompts, length +1 a pass", prefill)):
            walls = []
            for pieces in passes:
                torch.cuda.synchronize()
                began = time.perf_counter()
                decoder.forward(pieces)
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - began)
            print(f"{case:<34} {name:<34} {statistics.median(walls) * 1e3:>14.2f}")
        attention.KEY_ALIGN, attention.CUDA_BACKENDS = saved


if __name__ == "__main__":
    main()
