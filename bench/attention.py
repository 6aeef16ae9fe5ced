"""Paged decode attention on the GPU: our Triton kernel beside the well-kept alternatives, in one run.

    python bench/attention.py

One query row a lane over its context (Qwen2.5-0.5B's heads: 14 query, 2 KV, head dim 64; bf16), lanes'
blocks scattered through a pool. Contenders: the eager path (gather the lanes' blocks, then SDPA),
FlexAttention (compiled) over the same gathered keys with a length mask, and the Triton kernel reading
block tables directly, at two tile sizes, each with the context in one program a lane and head or split over several,
and over an fp8 cache (e4m3 and an exponent a token's head, checked against the eager path over the same cache). Checks every output against the eager path, then prints
one table of microseconds a call (device time: calls captured in a CUDA graph, replays timed with events).
"""

from __future__ import annotations

import statistics

import torch

from lanes.gpu import fp8, kernels
from lanes.gpu.attention import PagedRows, RowSpan, paged_attention

HQ, HKV, D, BS = 14, 2, 64, 16


def timed(fn, repeat: int = 20, calls: int = 10) -> float:
    """Microseconds a call, device time only: `calls` calls captured in a CUDA graph, replays timed with events
    (launching from Python here would time the launch, not the kernel)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def case(lanes: int, context: int):
    g = torch.Generator(device="cuda").manual_seed(lanes + context)
    per_lane = -(-context // BS)
    pool = lanes * per_lane + 8
    cache_k = torch.randn(pool * BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cache_v = torch.randn(pool * BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    order = torch.randperm(pool, device="cuda", generator=g)[: lanes * per_lane].view(lanes, per_lane)
    lens = torch.full((lanes,), context, dtype=torch.int64, device="cuda")
    q = torch.randn(lanes, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    spans = [RowSpan(context - 1, 1, order[i].tolist()) for i in range(lanes)]
    return q, cache_k, cache_v, order, lens, PagedRows(spans, BS, torch.device("cuda"))


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for lanes, context in [(1, 256), (16, 256), (64, 256), (64, 1024), (1, 4096)]:
        q, ck, cv, tables, lens, paged = case(lanes, context)
        scale = D**-0.5
        reference = paged_attention(q, ck, cv, paged, scale).float()
        results = {"gather + SDPA": timed(lambda: paged_attention(q, ck, cv, paged, scale))}
        kp = ck.index_select(0, paged.k_slots).view(lanes, context, HKV, D).transpose(1, 2)
        vp = cv.index_select(0, paged.k_slots).view(lanes, context, HKV, D).transpose(1, 2)
        lens_dev = lens

        def inside(b, h, q_idx, kv_idx):
            return kv_idx < lens_dev[b]

        try:
            mask = create_block_mask(inside, lanes, None, 1, context, device="cuda")
            qf = q[:, :, None, :]

            def run_flex():
                gathered_k = ck.index_select(0, paged.k_slots).view(lanes, context, HKV, D).transpose(1, 2)
                gathered_v = cv.index_select(0, paged.k_slots).view(lanes, context, HKV, D).transpose(1, 2)
                return flex(qf, gathered_k, gathered_v, block_mask=mask, scale=scale, enable_gqa=True)

            out = run_flex()[:, :, 0, :].float()
            assert ((out - reference).norm() / reference.norm()).item() < 1e-2
            results["gather + FlexAttention"] = timed(run_flex)
        except Exception as error:  # reported, not fatal: the table says what could not run
            print(f"FlexAttention failed at {lanes}x{context}: {type(error).__name__}: {error}")
        del kp, vp
        for tile, splits in ((32, 1), (64, 1), (32, None), (64, None)):
            out = kernels.paged_decode_attention(q, ck, cv, tables, lens, scale, BS, tile=tile, splits=splits).float()
            error = ((out - reference).norm() / reference.norm()).item()
            assert error < 1e-2, error
            name = f"Triton tile {tile}, " + ("no split" if splits == 1 else f"{kernels.context_splits(lanes, HKV, context, tile)} splits")
            results[name] = timed(lambda: kernels.paged_decode_attention(q, ck, cv, tables, lens, scale, BS, tile=tile, splits=splits))
        k8, k_exp = fp8.quantize(ck)  # the fp8 cache (--kv-cache fp8): half the bytes read
        v8, v_exp = fp8.quantize(cv)
        quantized = paged_attention(q, k8, v8, paged, scale, (k_exp, v_exp)).float()
        out = kernels.paged_decode_attention(q, k8, v8, tables, lens, scale, BS, k_exp=k_exp, v_exp=v_exp).float()
        assert ((out - quantized).norm() / quantized.norm()).item() < 1e-2
        name = f"Triton fp8 KV, {kernels.context_splits(lanes, HKV, context, 64)} splits"
        results[name] = timed(lambda: kernels.paged_decode_attention(q, k8, v8, tables, lens, scale, BS, k_exp=k_exp,
                                                                     v_exp=v_exp))
        rows.append((lanes, context, results))
    names = list(dict.fromkeys(name for _, _, r in rows for name in r))
    print(f"\npaged decode attention, bf16, {HQ} query / {HKV} KV heads, head dim {D}, {torch.cuda.get_device_name()} (us a call)")
    print(f"{'lanes x context':<16}" + "".join(f"{n:>24}" for n in names))
    for lanes, context, results in rows:
        print(f"{f'{lanes} x {context}':<16}" + "".join(f"{results[n]:>24.1f}" if n in results else f"{'-':>24}" for n in names))


if __name__ == "__main__":
    main()
