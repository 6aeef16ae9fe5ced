"""Small-batch GEMV on the GPU: our Triton kernels beside cuBLAS for the decode step's projections, in one run.

    python bench/gemv.py [--rows 1,2,4,8,16,64] [--log gemv.log] [--workers 16]

Qwen2.5-0.5B's projections in bf16 (qkv 1152x896 with bias, o 896x896, gate_up 9728x896, down 896x4864,
lm_head 151936x896) at M rows. Contenders: F.linear (cuBLAS); at M = 1 also F.linear on a 1-D input and
torch.mv (addmv with the bias); lanes.gpu.gemv over a sweep of tile configurations (the best, and the
default rule's pick); then the fused kernels against the launches they replace (add_rms_norm + F.linear,
silu_mul + F.linear, add_rms_norm + F.linear + silu_mul), each over the plain sweep's best tiles and the
default. A call's time is its share of a CUDA graph of many back-to-back calls (launch gaps as in the
decode graph) cycling through copies of the weight that together pass L2, as a step's 24 layers do.
Every result is checked on the device against a float32 product (one bf16 rounding plus float32
accumulation's worst case); the fused kernels' h and silu products must equal add_rms_norm's and
silu_mul's bit for bit (checked through identity weights). Kernels are compiled first by --workers
processes into Triton's cache. Prints three tables and the headline: the projections of one decode step
(24 layers and the head) at M = 1 and 16. Without CUDA it prints a line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (1152, 896, True), "o": (896, 896, False), "gate_up": (9728, 896, False),
          "down": (896, 4864, False), "lm_head": (151936, 896, False)}
FUSED = [("qkv", "norm"), ("gate_up", "norm"), ("lm_head", "norm"), ("down", "silu"), ("gate_up", "gated")]
ROTATE_BYTES = 256 << 20  # weight copies a graph cycles through: five times the H200's L2
EPS = 1e-6


def candidates(m: int, n: int, k: int) -> list:
    """The tiles swept for one shape: FMA tiles up to 8 rows, dot tiles from 2 (whole-K chunks too, for
    K <= 1024), and K splits where the tiles are fewer than two a multiprocessor; always the default."""
    import triton

    from lanes.gpu.gemv import GemvConfig, default_config

    configs = []
    if m <= 8:
        bm = triton.next_power_of_2(m)
        tiles = ((1, 1024), (2, 1024), (2, 512), (4, 1024), (4, 512), (4, 256), (8, 1024), (8, 512), (8, 256),
                 (8, 128), (16, 512), (16, 256), (16, 128))
        for bn, bk in tiles + (((1, 2048), (2, 2048)) if k > 1024 else ()):
            if bm * bn * bk <= 8192:  # at most 64 float32 accumulators a thread at 4 warps
                configs.append(GemvConfig(bn, bk, block_m=bm))
                if bn * bk == 8192 and bm == 1:
                    configs.append(GemvConfig(bn, bk, block_m=bm, num_warps=8))
    if m >= 2:
        tiles = ((16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 3, 4), (128, 128, 3, 4))
        if k <= 1024:
            tiles += ((16, 1024, 1, 4), (32, 1024, 1, 8))
        for bm in (16,) if m <= 16 else (16, 64):
            for bn, bk, stages, warps in tiles:
                configs.append(GemvConfig(bn, bk, block_m=bm, dot=True, num_stages=stages, num_warps=warps))
    configs += [split for c in configs for split in splits(c, m, n, k)]
    configs.append(default_config(m, n, k))
    return list(dict.fromkeys(configs))


def splits(c, m: int, n: int, k: int) -> list:
    """c with K split for about 132, 264 and 528 programs, where its tiles are fewer than 264."""
    tiles, chunks = -(-n // c.block_n) * -(-m // c.block_m), -(-k // c.block_k)
    shares = {min(chunks, -(-programs // tiles)) for programs in (132, 264, 528)} if tiles < 264 else set()
    return [type(c)(**{**c.__dict__, "split_k": split}) for split in sorted(shares) if split > 1]


def fused_default(kind: str, m: int, n: int, k: int):
    """The tile our fused kernel picks by itself (n: the plain GEMV's columns, both halves when gated)."""
    from lanes.gpu.gemv import default_config, gated_config, silu_config

    return gated_config(m, n // 2, k) if kind == "gated" else silu_config(m, n, k) if kind == "silu" else \
        default_config(m, n, k)


def fused_candidates(kind: str, m: int, n: int, k: int, tops: list) -> list:
    """The plain sweep's best six tiles, the best two FMA ones also with twice the columns (four times
    too for silu: a program computes its rows' prologue once, so fewer programs compute less), the
    whole-K dot tiles (h computed once), the default."""
    from lanes.gpu.gemv import GemvConfig

    configs = list(tops[:6])
    widths = (2, 4) if kind == "silu" else (2,)  # silu: each program recomputes its K's products
    configs += [type(c)(**{**c.__dict__, "block_n": w * c.block_n}) for c in tops[:2] if not c.dot for w in widths]
    if 2 <= m <= 16 and k <= 1024:
        configs += [GemvConfig(16, 1024, block_m=16, dot=True, num_stages=1),
                    GemvConfig(32, 1024, block_m=16, dot=True, num_stages=1, num_warps=8)]
    configs.append(fused_default(kind, m, n, k))
    return list(dict.fromkeys(configs))


def run(kind: str, x, weight, bias, config, residual=None, norm_weight=None):
    """One call of our kernel `kind` (plain, norm, silu, gated) -> its output (without the residual)."""
    from lanes.gpu import gemv

    if kind == "plain":
        return gemv.gemv(x, weight, bias, config)
    if kind == "silu":
        return gemv.silu_gemv(x, weight, bias, config)
    fn = gemv.norm_gemv if kind == "norm" else gemv.norm_gate_up_silu
    return fn(x, residual, norm_weight, EPS, weight, bias, config)[0]


def compile_jobs(jobs: list, workers: int) -> None:
    """Compile (kind, m, k, bias, config) kernels in parallel processes, into Triton's on-disk cache:
    a tiny N compiles the same binary (M and N are not specialised; every N here is a multiple of 16)."""
    unique = {(kind, k, bias, c): m for kind, m, k, bias, c in jobs}  # M is a run-time argument: one binary
    jobs = [(kind, m, k, bias, c) for (kind, k, bias, c), m in unique.items()]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[kind, m, k, bias, c.__dict__] for kind, m, k, bias, c in jobs], f)
    procs = [subprocess.Popen([sys.executable, __file__, "--compile", f.name, f"{i}/{workers}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the sweep logs failures
             for i in range(min(workers, len(jobs)))]
    for p in procs:
        p.wait()
    os.unlink(f.name)


def compile_shard(path: str, shard: str) -> None:
    from lanes.gpu.gemv import GemvConfig

    index, count = map(int, shard.split("/"))
    for kind, m, k, bias, fields in json.load(open(path))[index::count]:
        n = 64
        dev = dict(device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, 2 * k if kind == "silu" else k, **dev)
        w = torch.randn(2 * n if kind == "gated" else n, k, **dev)
        b = torch.randn(w.shape[0], **dev) if bias else None
        try:
            run(kind, x, w, b, GemvConfig(**fields), torch.randn(m, k, **dev), torch.ones(k, **dev))
        except Exception as error:  # the sweep meets it again, and logs it
            print(f"compile {kind} m{m} k{k} {GemvConfig(**fields)}: {type(error).__name__}: {str(error)[:200]}")
    torch.cuda.synchronize()


def event_us(fn) -> float:
    """Microseconds of fn() on the device, timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def timed(call, copies: int, repeat: int = 10) -> float:
    """Microseconds a call: max(copies, 24) calls, call(i) reading weight copy i % copies, captured in one
    CUDA graph; the median over replays."""
    calls = max(copies, 24)
    for i in range(3):
        call(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % copies)
    graph.replay()
    return statistics.median(event_us(graph.replay) / calls for _ in range(repeat))


def copy_rate() -> float:
    """TB/s of a 1 GiB device-to-device copy (bytes read plus written; the best of 5, launched directly:
    a copy captured in a graph runs slower), the ceiling to compare with."""
    src, dst = (torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(2))
    return 2 * src.numel() / min(event_us(lambda: dst.copy_(src)) for _ in range(6)) / 1e6


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |t|."""
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(2.0**-126))) - 7)


def slack(x, w) -> torch.Tensor:
    """float32 accumulation's worst case over K terms, counted four times for the tensor cores'."""
    return 4 * x.shape[1] * 2.0**-24 * (x.float().abs() @ w.float().abs().T)


def excess(out, ref32, x, w) -> float:
    """max(|out - ref| - bound) over elements: <= 0 when every element is within one bf16 rounding plus
    float32 accumulation's worst case."""
    return ((out.float() - ref32).abs() - ulp(ref32) - slack(x, w)).max().item()


def gated_excess(out, h, w) -> float:
    """excess() for silu(gate) * up: the bounds on gate and up carried through silu (|silu'| < 1.1), its
    rounding, and the product."""
    gate_up = F.linear(h.float(), w.float())
    (gate, up), (err_gate, err_up) = gate_up.chunk(2, dim=-1), (ulp(gate_up) + slack(h, w)).chunk(2, dim=-1)
    silu = F.silu(gate)
    err = (1.1 * err_gate + ulp(silu.abs() + 1.1 * err_gate)) * (up.abs() + err_up) + silu.abs() * err_up
    ref = silu * up
    return ((out.float() - ref).abs() - err - ulp(ref.abs() + err)).max().item()


class Case:
    """One shape at M rows: inputs, weight copies past L2, the float32 reference and the baselines."""

    def __init__(self, name: str, m: int, kernels):
        n, k, has_bias = SHAPES[name]
        self.name, self.m, self.n, self.k = name, m, n, k
        self.bytes = n * k * 2
        self.copies = max(1, -(-ROTATE_BYTES // self.bytes))
        dev = dict(device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(self.copies, n, k, **dev) * k**-0.5
        self.b = torch.randn(n, **dev) if has_bias else None
        self.x = torch.randn(m, k, **dev)
        self.residual = torch.randn(m, k, **dev)
        self.norm_weight = 1 + 0.1 * torch.randn(k, **dev)
        self.gate_up = torch.randn(m, 2 * k, **dev)
        self.ref = F.linear(self.x.float(), self.w[0].float(), None if self.b is None else self.b.float())
        self.linear = F.linear(self.x, self.w[0], self.b)
        self.kernels = kernels

    def gbs(self, us: float) -> float:
        return self.bytes / us / 1e3

    def fused_inputs(self, kind: str):
        """The fused kernel's input and the unfused path's GEMV input (h or silu_mul's product)."""
        if kind == "silu":
            return self.gate_up, self.kernels.silu_mul(self.gate_up)
        return self.x, self.kernels.add_rms_norm(self.x, self.residual, self.norm_weight, EPS)[0]

    def unfused(self, kind: str, i: int, config=None):
        """The launches a fused kernel replaces, the GEMV through cuBLAS or (with a config) ours."""
        kernels, w = self.kernels, self.w[i]
        linear = F.linear if config is None else lambda x, w, b: run("plain", x, w, b, config)
        if kind == "silu":
            return linear(kernels.silu_mul(self.gate_up), w, self.b)
        h, _ = kernels.add_rms_norm(self.x, self.residual, self.norm_weight, EPS)
        out = linear(h, w, self.b)
        return kernels.silu_mul(out) if kind == "gated" else out


def exact(kind: str, case: Case, config) -> bool:
    """The fused kernel's h (or silu product) equals add_rms_norm's (silu_mul's), through identity weights;
    its new residual equals add_rms_norm's."""
    from lanes.gpu import gemv

    k = case.k
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    if kind == "silu":
        return torch.equal(gemv.silu_gemv(case.gate_up, eye, None, config), case.kernels.silu_mul(case.gate_up))
    h, res = case.kernels.add_rms_norm(case.x, case.residual, case.norm_weight, EPS)
    if kind == "norm":
        same, new_res = gemv.norm_gemv(case.x, case.residual, case.norm_weight, EPS, eye, None, config)
        return torch.equal(same, h) and torch.equal(new_res, res)
    same, new_res = gemv.norm_gate_up_silu(case.x, case.residual, case.norm_weight, EPS, torch.cat([eye, eye]),
                                           None, config)
    return torch.equal(same, case.kernels.silu_mul(torch.cat([h, h], dim=-1))) and torch.equal(new_res, res)


def sweep_plain(case: Case, log) -> dict:
    """cuBLAS, the 1-D and mv baselines, and every candidate tile -> the row of the first table."""
    from lanes.gpu.gemv import default_config

    x, w, b = case.x, case.w, case.b
    row = {"cublas": timed(lambda i: F.linear(x, w[i], b), case.copies),
           "cublas_err": (case.linear.float() - case.ref).abs().max().item(), "tried": []}
    if case.m == 1:
        row["linear_1d"] = timed(lambda i: F.linear(x[0], w[i], b), case.copies)
        row["mv"] = timed((lambda i: torch.addmv(b, w[i], x[0])) if b is not None else (lambda i: torch.mv(w[i], x[0])),
                          case.copies)
    for config in candidates(case.m, case.n, case.k):
        try:
            out = run("plain", x, w[0], b, config)
            over = excess(out, case.ref, x, w[0])
            if over > 0:
                raise AssertionError(f"outside the bound by {over:.3g}")
            us = timed(lambda i: run("plain", x, w[i], b, config), case.copies)
        except Exception as error:  # one bad tile is a line in the log, not the end of the run
            print(f"{case.name} m{case.m} {config}: {type(error).__name__}: {str(error)[:300]}", file=log)
            row["failed"] = row.get("failed", 0) + 1
            continue
        err = (out.float() - case.linear.float()).abs().max().item()
        row["tried"].append((us, config, err))
        print(f"{case.name} m{case.m} {config}: {us:.2f} us {case.gbs(us):.0f} GB/s err {err:.3g}", file=log)
        if config == default_config(case.m, case.n, case.k):
            row["default"] = us
    row["tried"].sort(key=lambda t: t[0])
    return row


def sweep_fused(kind: str, case: Case, tops: list, log) -> dict:
    """The unfused launches (with cuBLAS, and with our best plain tile), and our fused kernel over
    fused_candidates -> the row of the second table."""
    fused_x, gemv_x = case.fused_inputs(kind)
    unfused = case.unfused(kind, 0)
    ref = F.linear(gemv_x.float(), case.w[0].float(), None if case.b is None else case.b.float())
    row = {"unfused": timed(lambda i: case.unfused(kind, i), case.copies), "tried": []}
    if tops:
        row["unfused_ours"] = timed(lambda i: case.unfused(kind, i, tops[0]), case.copies)
    args = dict(residual=case.residual, norm_weight=case.norm_weight)
    default = fused_default(kind, case.m, case.n, case.k)
    for config in fused_candidates(kind, case.m, case.n, case.k, tops):
        try:
            out = run(kind, fused_x, case.w[0], case.b, config, **args)
            over = gated_excess(out, gemv_x, case.w[0]) if kind == "gated" else excess(out, ref, gemv_x, case.w[0])
            if over > 0:
                raise AssertionError(f"outside the bound by {over:.3g}")
            same = exact(kind, case, config)
            us = timed(lambda i: run(kind, fused_x, case.w[i], case.b, config, **args), case.copies)
        except Exception as error:  # reported in the log
            print(f"{kind} {case.name} m{case.m} {config}: {type(error).__name__}: {str(error)[:300]}", file=log)
            continue
        err = (out.float() - unfused.float()).abs().max().item()
        row["tried"].append((us, config, err, same))
        print(f"{kind} {case.name} m{case.m} {config}: {us:.2f} us exact {same} err {err:.3g}", file=log)
        if config == default:
            row["default"] = (us, same)
    row["tried"].sort(key=lambda t: (not t[3], t[0]))  # bit-identical first, then the fastest
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--log", default=os.devnull, help="every tile's time and error, and every failure")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--compile", nargs=2, help=argparse.SUPPRESS)  # a compile worker: jobs file, shard
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gemv.py: no CUDA device, skipped")
        return
    if args.compile:
        return compile_shard(*args.compile)
    from lanes.gpu import kernels

    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    log = open(args.log, "w", buffering=1)
    compile_jobs([("plain", m, k, bias, c) for m in rows for n, k, bias in SHAPES.values()
                  for c in candidates(m, n, k)], args.workers)
    copy_tbs = copy_rate()
    plain = {(name, m): sweep_plain(Case(name, m, kernels), log) for name in SHAPES for m in rows}
    tops = {key: [c for _, c, _ in row["tried"]] for key, row in plain.items()}
    compile_jobs([(kind, m, SHAPES[name][1], bias, c) for name, kind in FUSED for m in rows
                  for c in fused_candidates(kind, m, SHAPES[name][0], SHAPES[name][1], tops[name, m])
                  for bias in {SHAPES[name][2], False}], args.workers)  # exact() runs without the bias
    fused = {(kind, name, m): sweep_fused(kind, Case(name, m, kernels), tops[name, m], log)
             for name, kind in FUSED for m in rows}
    report(plain, fused, rows, copy_tbs)


def report(plain: dict, fused: dict, rows: list, copy_tbs: float) -> None:
    nan = float("nan")
    print(f"\nsmall-batch GEMV, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}, device copy "
          f"{copy_tbs:.2f} TB/s (read + write); us a call in a CUDA graph, GB/s = weight bytes / time")
    print(f"{'shape':<8}{'M':>3}{'cuBLAS':>9}{'GB/s':>6}{'1-D':>7}{'mv':>7}{'default':>9}{'GB/s':>6}{'best':>8}"
          f"{'GB/s':>6}{'x cuBLAS':>9}  {'best config':<30}{'err cuBLAS':>11}{'err ours':>10}{'fail':>5}")
    for (name, m), r in plain.items():
        gbs = lambda us: SHAPES[name][0] * SHAPES[name][1] * 2 / us / 1e3  # noqa: E731
        best, config, err = r["tried"][0] if r["tried"] else (nan, "-", nan)
        d = r.get("default", nan)
        print(f"{name:<8}{m:>3}{r['cublas']:>9.2f}{gbs(r['cublas']):>6.0f}{r.get('linear_1d', nan):>7.2f}"
              f"{r.get('mv', nan):>7.2f}{d:>9.2f}{gbs(d):>6.0f}{best:>8.2f}{gbs(best):>6.0f}{r['cublas'] / best:>9.2f}"
              f"  {str(config):<30}{r['cublas_err']:>11.3g}{err:>10.3g}{r.get('failed', 0):>5}")
    print("\nfused kernels against the launches they replace (us a call; exact: h or the silu product bit-identical)")
    print(f"{'fused':<6}{'shape':<8}{'M':>3}{'unfused':>9}{'default':>9}{'exact':>6}{'best':>8}{'exact':>6}"
          f"{'x unfused':>10}  {'best config':<30}{'|fused-unfused|':>16}")
    for (kind, name, m), r in fused.items():
        best, config, err, same = r["tried"][0] if r["tried"] else (nan, "-", nan, False)
        d, d_same = r.get("default", (nan, False))
        print(f"{kind:<6}{name:<8}{m:>3}{r['unfused']:>9.2f}{d:>9.2f}{'yes' if d_same else 'NO':>6}{best:>8.2f}"
              f"{'yes' if same else 'NO':>6}{r['unfused'] / best:>10.2f}  {str(config):<30}{err:>16.3g}")
    step_bytes = sum((1 if name == "lm_head" else 24) * n * k * 2 for name, (n, k, _) in SHAPES.items())
    print(f"\nheadline: one decode step's projections (24 layers of qkv, o, gate_up, down, then lm_head; "
          f"{step_bytes / 1e9:.3f} GB of weights: {step_bytes / copy_tbs / 1e6:.0f} us at the copy rate)")
    print(f"{'path':<58}" + "".join(f"{f'M={m} us':>12}{'TB/s':>6}" for m in (1, 16) if m in rows))
    fastest = lambda row: row["tried"][0][0] if row["tried"] else nan  # noqa: E731
    ours = lambda name, m: fastest(plain[name, m])  # noqa: E731
    fus = lambda kind, name, m: fastest(fused[kind, name, m])  # noqa: E731
    pair = lambda name, m, key: fused["silu" if name == "down" else "norm", name, m].get(key, nan)  # noqa: E731
    lines = {
        "cuBLAS GEMMs alone": lambda m: [plain[n, m]["cublas"] for n in SHAPES],
        "ours, best tiles": lambda m: [ours(n, m) for n in SHAPES],
        "ours, default tiles": lambda m: [plain[n, m].get("default", nan) for n in SHAPES],
        "unfused: add_rms_norm/silu_mul + cuBLAS": lambda m: [
            plain[n, m]["cublas"] if n == "o" else pair(n, m, "unfused") for n in SHAPES],
        "unfused: add_rms_norm/silu_mul + ours (best tiles)": lambda m: [
            ours(n, m) if n == "o" else pair(n, m, "unfused_ours") for n in SHAPES],
        "fused: norm_gemv qkv, gemv o, norm_gemv gate_up, silu_gemv": lambda m: [
            fus("norm", "qkv", m), ours("o", m), fus("norm", "gate_up", m), fus("silu", "down", m),
            fus("norm", "lm_head", m)],
        "fused: norm_gemv qkv, gemv o, norm_gate_up_silu, gemv down": lambda m: [
            fus("norm", "qkv", m), ours("o", m), fus("gated", "gate_up", m), ours("down", m),
            fus("norm", "lm_head", m)],
    }
    for label, times in lines.items():
        totals = [step(times(m)) for m in (1, 16) if m in rows]
        print(f"{label:<58}" + "".join(f"{t:>12.1f}{step_bytes / t / 1e6:>6.2f}" for t in totals))


def step(times: list) -> float:
    """Microseconds of one step from per-call times in SHAPES order (qkv, o, gate_up, down, lm_head)."""
    qkv, o, gate_up, down, head = times
    return 24 * (qkv + o + gate_up + down) + head


if __name__ == "__main__":
    main()
