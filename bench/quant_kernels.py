"""Weight-only quantized matmul kernels on the CPU beside the fp32 matmul, at the default model's shapes.

    python bench/quant_kernels.py [--rows 1,8,64,256] [--shapes qkv,o,gate_up,down,head] [--rounds 15]
                                  [--threads N] [--batch-ms 1] [--only a,b] [--no-inductor] [--no-torchao]

SmolLM2-135M's matrices (out x in): qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, and the tied
head 49152x576; x is [rows, in] fp32. Every contender holds as many copies of its weight as the model has
layers (30; the head one), and each call takes the next copy, so a call reads its weight from memory as a
decode step does, not from a cache that a repeated call would keep warm. Contenders (those that fail to
build are left out with the reason):
  fp32            F.linear on the dequantized fp32 weight (what lanes runs today)
  bf16            F.linear in bf16 (oneDNN)
  int8pack        torch._weight_int8pack_mm, int8 with one scale a row
  int4pack        torch._weight_int4pack_mm_for_cpu, int4 with scale and zero a group of 32
  dyn4bit         torch._dyn_quant_matmul_4bit (_dyn_quant_pack_4bit_weight), groups of 32
  ao-int8         torchao's Int8WeightOnlyConfig on an nn.Linear (torchao 0.18's CPU int4 is a prototype
                  over _weight_int4pack_mm_for_cpu, measured as int4pack)
  ind-q8/ind-q4   torch.compile (inductor) of dequantize-then-matmul over Q8_0-like / Q4_1-like planes
  ours-<T>-int8   lanes.quant: Q4_1 / Q8_0 read in place, activations rounded to 8 bits a group of 32,
                  integer dot products (AVX-512 VNNI), any number of rows
  ours-Q4_K/Q6_K  lanes.quant's few-rows path on the K-quants of Q4_K_M files (random blocks), fp32
  ours-f32        lanes.quant's fp32 product of few rows (`mm_f32`: the weight read once for all, fetched
                  ahead as this CPU's schedule does, `weight.spread_fetch`)
A contender over 20x fp32's time at some row count is not run at larger ones. Timing: after a warm-up,
rounds in which every contender runs in turn (interleaved), each a batch of calls of at least `--batch-ms`; the
figure is the median over rounds of the time a call (the best round beside it: on a shared machine, the
closest to an idle one). `x fp32` is fp32's median over the contender's; `GB/s` is the weight bytes a
call reads over its median time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import lanes  # noqa: F401  (first: OpenMP's threads wait passively, as in lanes, not spinning against our pool's)
import gguf
import numpy as np
import torch
import torch.nn.functional as F

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
LAYERS = 30


class Contender:
    def __init__(self, name: str, calls: list[Callable[[torch.Tensor], torch.Tensor]], weight_bytes: int):
        self.name, self.calls, self.weight_bytes, self.next = name, calls, weight_bytes, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.next = (self.next + 1) % len(self.calls)
        return self.calls[self.next](x)


def q4_planes(raw: np.ndarray, n: int, k: int):
    """Q4_1 rows as torch planes: nibbles [n, k/2] uint8 (value 2i low, 2i+1 high), d and m [n, k/32] fp16."""
    blocks = raw.reshape(n, k // 32, 20)
    d = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0])
    m = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0])
    q = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(n, k))
    q = torch.round((q - m.float().repeat_interleave(32, 1)) / d.float().repeat_interleave(32, 1)).to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), d, m, q


def build(name: str, n: int, k: int, copies: int, raw4: np.ndarray, raw8: np.ndarray, dense: torch.Tensor,
          no_inductor: bool, no_torchao: bool) -> list[Contender]:
    """Every contender that builds here for an [n, k] weight; the rest are reported on stderr."""
    out: list[Contender] = []

    def add(label: str, make: Callable[[], tuple[Callable, int]]) -> None:
        try:
            made = [make() for _ in range(copies)]
            made[0][0](torch.randn(1, k))
            out.append(Contender(label, [m[0] for m in made], made[0][1]))
        except Exception as error:  # a contender that does not build here is reported, not fatal
            print(f"  {name}: {label} left out: {type(error).__name__}: {str(error).splitlines()[0][:120]}", file=sys.stderr)

    def fp32():
        w = dense.clone()
        return (lambda x: F.linear(x, w)), w.nbytes

    def bf16():
        w = dense.to(torch.bfloat16)
        return (lambda x: F.linear(x.to(torch.bfloat16), w).float()), w.nbytes

    def int8pack():
        scale = dense.abs().amax(1) / 127
        w = torch.round(dense / scale[:, None]).to(torch.int8)
        return (lambda x: torch._weight_int8pack_mm(x, w, scale)), w.nbytes + scale.nbytes

    _, d4, m4, q4 = q4_planes(raw4, n, k)

    def int4pack():
        packed = torch._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 1)
        # their dequantization is (q - 8) * scale + zero
        sz = torch.stack([d4.float(), (m4.float() + 8 * d4.float())], -1).transpose(0, 1).contiguous()
        return (lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)), packed.nbytes + sz.nbytes

    def dyn4bit():
        packed = torch._dyn_quant_pack_4bit_weight((q4[:, 0::2] | (q4[:, 1::2] << 4)).contiguous(), d4.float(), None, 32, k, n)
        return (lambda x: torch._dyn_quant_matmul_4bit(x, packed, 32, k, n)), packed.nbytes

    add("fp32", fp32)
    add("bf16", bf16)
    add("int8pack", int8pack)
    add("int4pack", int4pack)
    add("dyn4bit", dyn4bit)
    if not no_torchao:
        def ao_int8():
            from torchao.quantization import Int8WeightOnlyConfig, quantize_

            linear = torch.nn.Linear(k, n, bias=False)
            linear.weight.data.copy_(dense)
            quantize_(linear, Int8WeightOnlyConfig())
            inner, _ = linear.weight.__tensor_flatten__()
            return linear, sum(getattr(linear.weight, a).nbytes for a in inner)

        add("ao-int8", ao_int8)
    if not no_inductor:
        planes4, _, _, _ = q4_planes(raw4, n, k)
        blocks8 = raw8.reshape(n, k // 32, 34)
        q8 = torch.from_numpy(blocks8[:, :, 2:].copy().view(np.int8).reshape(n, k))
        d8 = torch.from_numpy(blocks8[:, :, 0:2].copy().view(np.float16)[..., 0])

        @torch.compile(dynamic=True)
        def ind_q4(x, p, d, m):
            q = torch.stack([p & 15, p >> 4], -1).reshape(n, k // 32, 32).float()
            w = (q * d.float()[..., None] + m.float()[..., None]).reshape(n, k)
            return x @ w.t()

        @torch.compile(dynamic=True)
        def ind_q8(x, q, d):
            w = (q.reshape(n, k // 32, 32).float() * d.float()[..., None]).reshape(n, k)
            return x @ w.t()

        def ind4():
            p, d, m = planes4.clone(), d4.clone(), m4.clone()
            return (lambda x: ind_q4(x, p, d, m)), p.nbytes + d.nbytes + m.nbytes

        def ind8():
            q, d = q8.clone(), d8.clone()
            return (lambda x: ind_q8(x, q, d)), q.nbytes + d.nbytes

        add("ind-q4", ind4)
        add("ind-q8", ind8)
    from lanes.quant import QuantWeight, block_format
    from lanes.quant.native import kernels
    from lanes.quant.weight import spread_fetch

    ops = kernels()
    for label, raw, kind in (("Q4_1", raw4, 3), ("Q8_0", raw8, 8)):
        def integer(raw=raw, kind=kind):
            w = QuantWeight(torch.from_numpy(raw.copy()), block_format(kind), (n, k)).packed
            return (lambda x: ops.mm_int8(x, w, kind, n, k)), w.nbytes

        add(f"ours-{label}-int8", integer)
    for kind in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
        def k_tiles(kind=kind):
            w = QuantWeight(torch.from_numpy(random_k_blocks(n, k, kind)), block_format(kind), (n, k)).packed
            return (lambda x: ops.mm_tiles(x, w, int(kind), n, k)), w.nbytes

        add(f"ours-{kind.name}-tiles", k_tiles)

    def few_rows():
        w = dense.clone()
        spread = spread_fetch()  # this CPU's fetch schedule, as the model's products run it
        return (lambda x: ops.mm_f32(x, w, spread)), w.nbytes

    add("ours-f32", few_rows)
    return out


def random_k_blocks(n: int, k: int, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """Random K-quant rows (the gguf package cannot quantize these) with small f16 scales: for timing only."""
    size, scale_at = (144, (0, 2)) if kind == gguf.GGMLQuantizationType.Q4_K else (210, (208,))
    blocks = np.random.default_rng(0).integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    for at in scale_at:
        blocks[:, :, at : at + 2] = np.full((n, k // 256), 1e-3, np.float16).view(np.uint8).reshape(n, -1, 2)
    return blocks.reshape(n, -1)


def per_call(fn: Callable[[], object], budget_s: float) -> tuple[int, float]:
    """How many calls make a batch of at least `budget_s`, and the time of one batch a call."""
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        took = time.perf_counter() - start
        if took >= budget_s:
            return calls, took / calls
        calls *= 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--no-torchao", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one a core)")
    parser.add_argument("--batch-ms", type=float, default=1.0, help="least time of one timed batch of calls")
    parser.add_argument("--only", default=None, help="comma-separated contender names (fp32 is always run)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    results = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = 1 if name == "head" else LAYERS
        print(f"{name} {n}x{k}: building {copies} copies of each contender ...", file=sys.stderr)
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        raw4 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
        raw8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        dense = torch.from_numpy(gguf.quants.dequantize(raw4, gguf.GGMLQuantizationType.Q4_1).reshape(n, k))
        contenders = build(name, n, k, copies, raw4, raw8, dense, args.no_inductor, args.no_torchao)
        if args.only:
            keep = {"fp32", *args.only.split(",")}
            contenders = [c for c in contenders if c.name in keep]
        slow: set[str] = set()
        for rows in (int(r) for r in args.rows.split(",")):
            contenders = [c for c in contenders if c.name not in slow]
            x = torch.randn(rows, k)
            batches = {}
            for c in contenders:
                c(x)
                batches[c.name] = per_call(lambda c=c: c(x), args.batch_ms / 1000)[0]
            times: dict[str, list[float]] = {c.name: [] for c in contenders}
            for _ in range(args.rounds):
                for c in contenders:
                    start = time.perf_counter()
                    for _ in range(batches[c.name]):
                        c(x)
                    times[c.name].append((time.perf_counter() - start) / batches[c.name])
            base = statistics.median(times["fp32"])
            for c in contenders:
                t = statistics.median(times[c.name])
                results.append((f"{name} {n}x{k}", rows, c.name, t * 1e6, min(times[c.name]) * 1e6, base / t,
                                c.weight_bytes / 1e6, c.weight_bytes / t / 1e9))
                if t > 20 * base:  # hopeless here; more rows would only take minutes
                    slow.add(c.name)
        del contenders
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; "
          f"median (and best) of {args.rounds} interleaved rounds")
    print(f"{'shape':<18} {'rows':>4} {'contender':<18} {'us/call':>9} {'best us':>9} {'x fp32':>7} {'weight MB':>9} {'GB/s':>6}")
    for shape, rows, label, us, best, ratio, mb, gbs in results:
        print(f"{shape:<18} {rows:>4} {label:<18} {us:>9.1f} {best:>9.1f} {ratio:>7.2f} {mb:>9.2f} {gbs:>6.1f}")


if __name__ == "__main__":
    main()
