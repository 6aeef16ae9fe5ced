"""GGUF-format weights on the GPU: Q4_K, Q8_0 and Q6_K kernels beside bf16 at a 7B model's shapes, in one run.

    python bench/gpu_quant.py [--rows 1,512] [--kinds Q4_K,Q8_0,Q6_K] [--dry]

Llama-2-7B's projections (q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008), weights of random
bytes with small scales (the kernels' speed does not depend on the values), built on the device. At 1 row
(decode) and at --rows' larger count (prefill): bf16 through F.linear (cuBLAS) and lanes.gpu.gemv (at 1
row); each GGUF type through lanes.gpu.quant's GEMV at its default tiles and the best of a small sweep,
and, for prefill, the fused tensor-core kernel beside dequantize-then-cuBLAS. A call's time is its share
of a CUDA graph of back-to-back calls cycling through weight copies that together pass L2 several times
over. Bandwidth columns: weight bytes over the time, and that over the copy bandwidth measured in the
same run (a 1 GiB device copy, bytes read plus written). Every product is checked against x @ W^T with W
decoded by the gguf package (first 64 rows). --dry runs tiny shapes on the CPU under Triton's interpreter
(a check of the script, no timings worth reading).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

SHAPES = {"qkvo": (4096, 4096), "gate/up": (11008, 4096), "down": (4096, 11008)}
DRY_SHAPES = {"qkvo": (32, 256), "gate/up": (48, 256), "down": (32, 512)}
ROTATE_BYTES = 256 << 20  # weight copies a graph cycles through: four times the H200's L2
SCALE_AT = {"Q8_0": (0, 34), "Q4_K": (0, 144), "Q6_K": (208, 210)}  # where each block's f16 d sits, block bytes


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def raw_blocks(kind: str, n: int, k: int, device, seed: int) -> torch.Tensor:
    """[n, row bytes] uint8 of random blocks whose f16 scales (and Q4_K's dmin) are small."""
    from lanes.quant import FORMATS
    import gguf

    fmt = FORMATS[int(gguf.GGMLQuantizationType[kind])]
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (n, fmt.row_bytes(k)), generator=g, device=device, dtype=torch.uint8)
    at, size = SCALE_AT[kind]
    blocks = raw.view(n, -1, size)
    scale = torch.tensor([2e-4 if kind != "Q8_0" else 2e-3], dtype=torch.float16).view(torch.uint8).to(device)
    blocks[:, :, at : at + 2] = scale
    if kind == "Q4_K":
        blocks[:, :, 2:4] = scale  # dmin
    return raw


def event_us(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def timed(call, copies: int, dry: bool, repeat: int = 10) -> float:
    """Microseconds a call: max(copies, 16) calls, call(i) reading weight copy i % copies, in one CUDA
    graph, the median over replays (on the CPU: one call, timed by the clock)."""
    if dry:
        began = time.perf_counter()
        call(0)
        return (time.perf_counter() - began) * 1e6
    calls = max(copies, 16)
    for i in range(2):
        call(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % copies)
    graph.replay()
    return statistics.median(event_us(graph.replay) / calls for _ in range(repeat))


def attempt(call, copies: int, dry: bool) -> float:
    """`timed`, or NaN where this tile does not compile or run here (the sweep goes on)."""
    try:
        return timed(call, copies, dry)
    except Exception as error:
        say(f"  a tile failed: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
        return float("nan")


def copy_rate(dry: bool) -> float:
    """Bytes read plus written a second by a 1 GiB device copy (the best of 5)."""
    if dry:
        src = torch.empty(1 << 26, dtype=torch.uint8)
        dst = torch.empty_like(src)
        began = time.perf_counter()
        dst.copy_(src)
        return 2 * src.numel() / (time.perf_counter() - began)
    src, dst = (torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(2))
    return 2 * src.numel() / min(event_us(lambda: dst.copy_(src)) for _ in range(6)) * 1e6


def reference_error(kind: str, weight, x: torch.Tensor, out: torch.Tensor) -> float:
    """Relative error of out's first 64 columns against x @ W^T, W's first 64 rows decoded by the gguf package."""
    import gguf

    rows = min(64, weight.shape[0])
    raw = weight.rows(torch.arange(rows)).file_bytes().cpu().numpy()
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, -1)).double()
    ref = x.double().cpu() @ w.T
    return ((out[:, :rows].double().cpu() - ref).norm() / ref.norm()).item()


def bf16_error(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> float:
    ref = x.double() @ w.double().T
    return ((out.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,512", help="rows of x: decode, then prefill")
    parser.add_argument("--kinds", default="Q4_K,Q8_0,Q6_K")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    args = parser.parse_args()
    if args.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    elif not torch.cuda.is_available():
        print("bench/gpu_quant.py: no CUDA device (use --dry for a check on the CPU)")
        return
    import torch.nn.functional as F

    from lanes.gpu import gemv as bf16_gemv
    from lanes.quant import FORMATS
    import gguf

    device = "cpu" if args.dry else "cuda"
    shapes = DRY_SHAPES if args.dry else SHAPES
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.dry:
        rows_list = [min(r, 24) for r in rows_list]
    kinds = args.kinds.split(",")
    bandwidth = copy_rate(args.dry)
    name = "CPU (dry run, interpreter)" if args.dry else torch.cuda.get_device_name()
    results = []  # (shape, rows, contender, us, bytes, flops, error, note)
    for shape, (n, k) in shapes.items():
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, generator=torch.Generator(device=device).manual_seed(rows)).bfloat16()
            dense_bytes = n * k * 2
            copies = max(1, min(16, ROTATE_BYTES // dense_bytes))
            say(f"{shape} [{n}, {k}], {rows} rows: bf16 ...")
            dense = [torch.randn(n, k, device=device, generator=torch.Generator(device=device).manual_seed(i)).mul_(0.02).bfloat16()
                     for i in range(copies)]
            flops = 2 * rows * n * k
            out = F.linear(x, dense[0])
            us = timed(lambda i: F.linear(x, dense[i]), copies, args.dry)
            results.append((shape, rows, "bf16 F.linear", us, dense_bytes, flops, bf16_error(x.float(), dense[0].float(), out.float()), ""))
            if rows <= 16:
                out = bf16_gemv.gemv(x, dense[0], None)
                us = timed(lambda i: bf16_gemv.gemv(x, dense[i], None), copies, args.dry)
                results.append((shape, rows, "bf16 lanes.gpu.gemv", us, dense_bytes, flops, bf16_error(x.float(), dense[0].float(), out.float()), ""))
            del dense
            for kind in kinds:
                fmt = FORMATS[int(gguf.GGMLQuantizationType[kind])]
                weight_bytes = n * fmt.row_bytes(k)
                copies = max(1, min(32, ROTATE_BYTES // weight_bytes))
                say(f"{shape} [{n}, {k}], {rows} rows: {kind} ...")
                try:
                    quantized_rows(results, kind, fmt, shape, n, k, rows, x, flops, weight_bytes, copies, device, args.dry)
                except Exception as error:  # one format's failure is a row of the table, not the end of the run
                    say(f"{kind} failed: {error!r}")
                    results.append((shape, rows, f"{kind} FAILED", float("nan"), weight_bytes, flops, float("nan"),
                                    str(error).splitlines()[0][:60] if str(error) else type(error).__name__))
    report(results, bandwidth, name, rows_list)


def quantized_rows(results, kind, fmt, shape, n, k, rows, x, flops, weight_bytes, copies, device, dry) -> None:
    """One GGUF type's rows of the table at this shape and row count."""
    from lanes.gpu import quant_kernels
    from lanes.gpu.quant import CudaQuantWeight, gemv_config, mm_config

    weights = [CudaQuantWeight(raw_blocks(kind, n, k, device, i), fmt, (n, k)) for i in range(copies)]
    if rows <= 16:
        default = gemv_config(rows, n, k, fmt.kind)
        tiles = ((1, 4), (1, 8), (2, 2), (2, 4), (2, 8), (4, 1), (4, 2)) if rows <= 4 else ((2, 1), (4, 1), (2, 2))
        sweep = [default] + ([] if dry else [dict(block_n=bn, sb=sb, split_k=s) for bn, sb in tiles for s in (1, 2, 4)])
        timings = []
        for config in sweep:
            call = lambda i, c=config: quant_kernels.gemv(x, weights[i].packed, fmt.kind, n, k, **c)
            timings.append((attempt(call, copies, dry), config))
        out = quant_kernels.gemv(x, weights[0].packed, fmt.kind, n, k, **default)
        error = reference_error(kind, weights[0], x, out)
        results.append((shape, rows, f"{kind} gemv (default)", timings[0][0], weight_bytes, flops, error, fmt_config(default)))
        best = min(timings, key=lambda t: t[0] if t[0] == t[0] else float("inf"))
        results.append((shape, rows, f"{kind} gemv (best)", best[0], weight_bytes, flops, error, fmt_config(best[1])))
    else:
        config = mm_config(rows, n, k)
        sweep = [config] + ([] if dry else [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                                                 for bm, bn, w, st in ((64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2))])
        timings = []
        for c in sweep:
            call = lambda i, c=c: quant_kernels.mm(x, weights[i].packed, fmt.kind, n, k, **c)
            timings.append((attempt(call, copies, dry), c))
        out = quant_kernels.mm(x, weights[0].packed, fmt.kind, n, k, **config)
        error = reference_error(kind, weights[0], x, out)
        results.append((shape, rows, f"{kind} fused mm (default)", timings[0][0], weight_bytes, flops, error, fmt_config(config)))
        best = min(timings, key=lambda t: t[0] if t[0] == t[0] else float("inf"))
        results.append((shape, rows, f"{kind} fused mm (best)", best[0], weight_bytes, flops, error, fmt_config(best[1])))
        call = lambda i: x @ weights[i].dequantize(torch.bfloat16).T
        us = timed(call, copies, dry)
        error = reference_error(kind, weights[0], x, call(0))
        results.append((shape, rows, f"{kind} dequantize+cuBLAS", us, weight_bytes, flops, error, ""))


def fmt_config(c: dict) -> str:
    return " ".join(f"{key.replace('block_', '').replace('num_', '')}{value}" for key, value in c.items())


def report(results: list, bandwidth: float, name: str, rows_list: list) -> None:
    print(f"GGUF weights on the GPU, Llama-2-7B projections, {name}, torch {torch.__version__}; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s (read + write); x bf16")
    print(f"{'shape':8} {'rows':>4}  {'contender':26} {'us':>9} {'x bf16':>7} {'MB':>7} {'GB/s':>7} {'of copy':>7} "
          f"{'TFLOP/s':>8} {'rel err':>9}  config")
    base = {(s, r): us for s, r, c, us, *_ in results if c == "bf16 F.linear"}
    for shape, rows, contender, us, nbytes, flops, error, note in results:
        rate = nbytes / (us * 1e-6)
        print(f"{shape:8} {rows:>4}  {contender:26} {us:>9.2f} {base[(shape, rows)] / us:>7.2f} {nbytes / 1e6:>7.1f} "
              f"{rate / 1e9:>7.0f} {rate / bandwidth:>7.2f} {flops / (us * 1e-6) / 1e12:>8.1f} {error:>9.2e}  {note}")
    print("x bf16: F.linear's time over this one's (above 1 is faster); of copy: weight bytes a second over the copy bandwidth")
    for rows in rows_list:
        step = {}
        for shape, r, contender, us, *_ in results:
            if r == rows:
                weight = 4 if shape == "qkvo" else 2 if shape == "gate/up" else 1  # a layer's projections of each shape
                step.setdefault(contender, []).append(weight * us)
        line = ", ".join(f"{c} {sum(v):.0f} us" for c, v in step.items() if len(v) == len(SHAPES))
        print(f"one layer's projections at {rows} rows: {line}")


if __name__ == "__main__":
    main()
