"""The GPU benchmark: our engine beside transformers on a Qwen2.5-0.5B-shaped model, in one run.

    python bench/gpu.py [--streams 1,16,64] [--prompt 128] [--new 128] [--repeats 5] [--quick] [--tp N]
    python bench/gpu.py --drafts ngram[,suffix] [--model M] [--draft-tokens 8]   (bench/gpu_drafts.py)

A model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
vocabulary 151936, tied embeddings) with random bf16 weights from a fixed seed, saved once and read by
every contender. 128-token prompts, 128 new tokens, end-of-sequence ignored, greedy. Contenders: our engine
in-process (CUDA graphs, and eager for reference) and through HTTP (its clients in processes of their own); transformers' generate() on a static
batch, generate() with the static cache, and generate_batch (continuous batching); and the floor, the
weight bytes over the copy bandwidth measured here. Our graphed settings run `--repeats` times and show the
median run (a run of a few hundred milliseconds moves with the host's noise). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

from lanes.core.lane_core import LaneCore
from lanes.core.passes import Piece
from lanes.core.plan import Plan, Work
from lanes.core.sampling import RowSampling, SamplingParams
from lanes.core.stream import Finished, Request, TokenEvent
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.core.blocks import BlockPool, BlockTable, blocks_for
from lanes.gpu.device import choose, runner_for
from lanes.heap import freeze_startup_heap
from lanes.loader import load_model

SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
             rope_theta=1000000.0, rms_norm_eps=1e-6)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build(folder: Path):
    """The random model, in bf16 on the GPU, saved with a small tokenizer for our loader."""
    from tokenizers import Tokenizer, models
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE)).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(256)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))
    return model


def load_bench_model(folder: Path, streams: int, prompt: int, new: int):
    """(transformers' model, ours loaded from its files in `folder` with KV for `streams` contexts of
    `prompt` + `new` tokens, `streams` random prompts from a fixed seed)."""
    say("building the model ...")
    reference = build(folder)
    model = load_model(folder, choose("cuda", "bf16"), kv_blocks=streams * blocks_for(prompt + new + 1) + 16)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, SHAPE["vocab_size"], (streams, prompt), generator=generator).tolist()
    return reference, model, prompts


def python_loop() -> float:
    """Seconds for 2,000,000 additions in a Python loop (best of three): how fast this host runs the event loop."""
    def once() -> float:
        began, total = time.perf_counter(), 0
        for i in range(2_000_000):
            total += i
        return time.perf_counter() - began

    return min(once() for _ in range(3))


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a large device-to-device copy (median of 10)."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 2 / statistics.median(times[2:])


async def run_engine(backend, model, prompts, new: int) -> tuple[float, float]:
    """(tokens/s, mean time to first token) for these prompts as concurrent streams."""
    core = LaneCore(backend, text_factory(model.tokenizer), [], max_rows=4096, max_queue=1024)
    sampling = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    firsts, produced = [], 0

    async def one(prompt):
        nonlocal produced
        start, first = time.perf_counter(), None
        stream = await core.submit(Request(tuple(prompt), sampling))
        async for event in stream.events:
            if first is None and isinstance(event, TokenEvent):
                first = time.perf_counter() - start
            if isinstance(event, Finished):
                produced += event.completion_tokens
        firsts.append(first)

    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        began = time.perf_counter()
        async with trio.open_nursery() as clients:
            for prompt in prompts:
                clients.start_soon(one, prompt)
        took = time.perf_counter() - began
        await core.shutdown(0)
    core.check_integrity()
    assert produced == new * len(prompts), produced
    return produced / took, statistics.mean(firsts)


async def run_http(backend, model, prompts, new: int, writers: int = 0) -> tuple[float, float]:
    """(tokens/s, mean time to first token) through the OpenAI API: the server here, its clients in
    processes of their own, a few streams each (one Python client parsing 64 streams was slower than the
    server, and a client sharing the server's event loop and GIL would be measured too)."""
    import multiprocessing
    import os

    from lanes.http.service import Service
    from lanes.runtime import Runtime

    core = LaneCore(backend, text_factory(model.tokenizer), [], max_rows=4096, max_queue=1024)
    service = Service(core, model.tokenizer, "bench", "qwen2", backend.shape.max_model_len, vocab_size=model.config.vocab_size,
                      stream_writers=writers)
    runtime = Runtime(service, port=0)
    spawn = multiprocessing.get_context("spawn")
    count = max(1, min(8, (os.cpu_count() or 2) // 2, len(prompts)))
    go, pipes, processes = spawn.Event(), [], []
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(runtime.run)
        for i in range(count):
            receive, send = spawn.Pipe(duplex=False)
            processes.append(spawn.Process(target=http_clients, args=(listening.url, prompts[i::count], new, send, go)))
            processes[-1].start()
            send.close()  # the clients' end only: a client process that dies ends the wait with EOFError
            pipes.append(receive)
        try:
            replies = [await trio.to_thread.run_sync(pipe.recv) for pipe in pipes]  # each "ready", or its failure
            go.set()  # every client process has started and connected: they begin together
            if all(kind == "ready" for kind, _ in replies):
                replies = [await trio.to_thread.run_sync(pipe.recv) for pipe in pipes]
        finally:
            go.set()
            for process in processes:
                await trio.to_thread.run_sync(process.join)
            runtime.request_stop()
    failures = [value for kind, value in replies if kind != "ok"]
    if failures:
        raise RuntimeError(f"the HTTP clients failed: {failures[0]}")
    produced = sum(value[0] for _, value in replies)
    assert produced == new * len(prompts), produced
    began, ended = min(value[1] for _, value in replies), max(value[2] for _, value in replies)
    return produced / (ended - began), statistics.mean(t for _, value in replies for t in value[3])


def http_clients(url: str, prompts, new: int, results, go) -> None:
    """In a client process: these prompts as streaming completions at once, once `go` is set; sends
    ("ready", None), then ("ok", (tokens, began, ended, first-token times)) or ("error", why)."""
    try:
        results.send(("ok", trio.run(_stream_all, url, prompts, new, results, go)))
    except Exception as error:  # reported to the benchmark, which prints it as the contender's failure
        results.send(("error", f"{type(error).__name__}: {error}"))


async def _stream_all(url: str, prompts, new: int, results, go):
    import httpx

    firsts, produced = [], 0
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await http.get("/v1/models")  # the first connection and the client's own imports, untimed
        results.send(("ready", None))
        await trio.to_thread.run_sync(go.wait)

        async def one(prompt):
            nonlocal produced
            start, first = time.perf_counter(), None
            body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and first is None:
                        first = time.perf_counter() - start
                    if line.startswith("data: {") and '"usage"' in line:
                        produced += json.loads(line[6:])["usage"]["completion_tokens"]
            firsts.append(first)

        began = time.perf_counter()  # the monotonic clock every process shares
        async with trio.open_nursery() as clients:
            for prompt in prompts:
                clients.start_soon(one, prompt)
        return produced, began, time.perf_counter(), firsts


def run_generate(model, prompts, new: int, **options) -> tuple[float, float]:
    ids = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(ids)

    def go(tokens: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       pad_token_id=0, **options)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    go(2)  # warm-up (and, with the static cache, its compilation)
    ttft = go(1)
    return len(prompts) * new / go(new), ttft


def run_generate_batch(model, prompts, new: int) -> tuple[float, float]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=[list(p) for p in prompts[:2]], generation_config=config, progress_bar=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=config, progress_bar=False)
    torch.cuda.synchronize()
    took = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in out.values())
    return produced / took, float("nan")


def greedy_plan(backend, lanes: int, reserve: int, piece, prompts: bool = False) -> tuple[Plan, list]:
    """A plan of one greedy piece a lane (all prompts, or all decode rows), over tables reserved for
    `reserve` tokens; `piece(lane, blocks)` makes each lane's. Returns the plan and the tables."""
    pool = BlockPool(backend.shape.blocks)
    tables = [BlockTable(("lane", i)) for i in range(lanes)]
    for t in tables:
        t.reserve(pool, reserve)
    greedy = SamplingParams(temperature=0, max_tokens=1)
    work = tuple(Work(piece(i, tuple(t.blocks)), sample=RowSampling(i, greedy, 0)) for i, t in enumerate(tables))
    return Plan(0, work, len(work) if prompts else 0), [(pool, t) for t in tables]


def pass_time(backend, plan: Plan, repeats: int) -> float:
    """Seconds a whole pass takes on the host clock (launched, waited for, read back), after warm-ups."""
    for _ in range(3):
        backend.launch(plan).result()
    began = time.perf_counter()
    for _ in range(repeats):
        backend.launch(plan).result()
    return (time.perf_counter() - began) / repeats


def clear_tables(tables) -> None:
    for pool, t in tables:
        t.clear(pool)


def step_times(backend, lanes: int, context: int) -> tuple[float, float]:
    """(graph replay, whole pass) seconds for one decode step of `lanes` lanes at `context` tokens.

    The replay is timed with CUDA events (device time only); the whole pass (input packing, replay,
    sampling, the read-back) with the host clock, as the lane core runs it minus the lane core itself.
    """
    plan, tables = greedy_plan(backend, lanes, context + 1, lambda lane, blocks: Piece(lane, (5,), context, blocks))
    with torch.cuda.stream(backend.runner.torch_stream):
        whole = pass_time(backend, plan, 30)
        replays = []
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            backend.graphs.run(plan.pieces)
            end.record()
            end.synchronize()
            replays.append(start.elapsed_time(end) / 1e3)
    clear_tables(tables)
    return statistics.median(replays), whole


def prompt_time(backend, prompts: int, length: int) -> float:
    """Seconds a whole pass of `prompts` fresh prompts of `length` tokens takes (host clock, as a step)."""
    plan, tables = greedy_plan(backend, prompts, length + 1,
                               lambda lane, blocks: Piece(lane, tuple(range(7, 7 + length)), 0, blocks), prompts=True)
    with torch.cuda.stream(backend.runner.torch_stream):
        took = pass_time(backend, plan, 10)
    clear_tables(tables)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="only our engine (no transformers peers)")
    parser.add_argument("--stream-writers", type=int, default=0, help="also through HTTP with this many stream writers")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each graphed engine setting; the median is shown")
    parser.add_argument("--tp", type=int, default=1, help="above 1: served --tp N beside --tp 1 (bench/gpu_tp.py)")
    parser.add_argument("--drafts", default=None,
                        help="ngram and/or suffix: drafts off and on, real prompts on --model (bench/gpu_drafts.py)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="with --drafts: the model that drafts run on")
    parser.add_argument("--draft-tokens", type=int, default=8, help="with --drafts: most draft tokens a lane a pass")
    args = parser.parse_args()
    if args.drafts:
        from gpu_drafts import main_drafts

        main_drafts(args)
        return
    if args.tp > 1:
        from gpu_tp import main_tp

        main_tp(args, build, SHAPE)
        return
    counts = [int(n) for n in args.streams.split(",")]
    most = max(counts)
    rows: list[tuple[str, int, float, float]] = []
    steps: list[tuple[int, float, float]] = []
    prompt_passes: dict[tuple[int, bool], float] = {}  # (prompts, graphs) -> seconds a pass
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        reference, model, prompts = load_bench_model(folder, most, args.prompt, args.new)
        weight_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
        placement = model.placement
        context = args.prompt + args.new

        def busy(run):
            """`run()`'s (tokens/s, ttft, the share of its wall time this thread, the event loop's, was busy)."""
            cpu, wall = time.thread_time(), time.perf_counter()
            rate, ttft = run()
            return rate, ttft, (time.thread_time() - cpu) / (time.perf_counter() - wall)

        def measure(name: str, n: int, run, repeats: int = 1) -> None:
            say(f"{name}, {n} streams ...")
            try:
                runs = sorted(busy(run) for _ in range(repeats))
            except Exception as error:  # a contender that fails is reported, and the table still prints
                say(f"{name} at {n} failed: {type(error).__name__}: {error}")
                return
            rate, ttft, _ = runs[len(runs) // 2]  # the median run: this host's noise moves a short run by 2x
            rows.append((name, n, rate, ttft))
            each = ", ".join(f"{r:.0f} ({b:.0%} busy)" for r, _, b in runs)
            say(f"  {rate:.0f} tok/s, ttft {ttft * 1e3:.1f} ms" + (f" (runs: {each})" if repeats > 1 else ""))

        for graphs in (True, False):
            backend = TorchBackend(model, runner_for(placement), lanes=most, max_model_len=context + 16, graphs=graphs)
            freeze_startup_heap()  # as `lanes serve` does once start-up is over
            trio.run(run_engine, backend, model, prompts[:2], 4)  # warm-up
            for n in counts if graphs else [1, most]:
                measure(f"lanes{'' if graphs else ' (eager)'}", n,
                        lambda: trio.run(run_engine, backend, model, prompts[:n], args.new), args.repeats if graphs else 1)
            if graphs:
                measure("lanes via HTTP", most, lambda: trio.run(run_http, backend, model, prompts[:most], args.new), args.repeats)
                if args.stream_writers:
                    measure(f"lanes via HTTP w{args.stream_writers}", most, lambda: trio.run(
                        run_http, backend, model, prompts[:most], args.new, args.stream_writers), args.repeats)
                for n in counts:
                    replay, whole = step_times(backend, n, args.prompt + args.new // 2)
                    steps.append((n, replay, whole))
            for n in (1, 16):
                prompt_passes[n, graphs] = prompt_time(backend, min(n, most), args.prompt)
        if not args.quick:
            for n in counts:
                measure("generate()", n, lambda: run_generate(reference, prompts[:n], args.new))
            measure("generate(static)", 1, lambda: run_generate(reference, prompts[:1], args.new, cache_implementation="static"))
            measure("generate_batch", most, lambda: run_generate_batch(reference, prompts, args.new))
        bandwidth = copy_bandwidth()
    floor_step = weight_bytes / bandwidth
    print(f"\nQwen2.5-0.5B shape, bf16, {torch.cuda.get_device_name()}, prompt {args.prompt}, new {args.new}, greedy")
    print(f"weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e12:.2f} TB/s, floor {floor_step * 1e3:.3f} ms a decode step")
    print(f"host: a fixed Python loop took {python_loop() * 1e3:.0f} ms (the host's speed, which bounds 64 streams)")
    print(f"{'contender':<18} {'streams':>7} {'tok/s':>9} {'ttft ms':>8} {'x generate()':>12} {'x best peer':>11} {'of floor':>8}")
    peers = {n: [r for name, m, r, _ in rows if m == n and not name.startswith("lanes")] for n in counts}
    generate = {n: r for name, n, r, _ in rows if name == "generate()"}
    for name, n, rate, ttft in rows:
        gen = f"{rate / generate[n]:.2f}" if n in generate and name.startswith("lanes") else ""
        ttft = float("nan") if ttft is None else ttft
        best = f"{rate / max(peers[n]):.2f}" if peers.get(n) and name.startswith("lanes") else ""
        floor = rate / (n / floor_step)
        print(f"{name:<18} {n:>7} {rate:>9.0f} {ttft * 1e3:>8.1f} {gen:>12} {best:>11} {floor:>8.2f}")
    for n in counts:
        print(f"{'floor':<18} {n:>7} {n / floor_step:>9.0f}")
    print(f"\n{'one decode step':<18} {'lanes':>7} {'graph ms':>9} {'pass ms':>8} {'graph tok/s':>12} {'pass tok/s':>11}")
    for n, replay, whole in steps:
        print(f"{'':<18} {n:>7} {replay * 1e3:>9.3f} {whole * 1e3:>8.3f} {n / replay:>12.0f} {n / whole:>11.0f}")
    print(f"\n{'one prompt pass':<18} {'prompts':>7} {'graph ms':>9} {'eager ms':>8} {'eager/graph':>12}")
    for n in (1, 16):
        graph, eager = prompt_passes[n, True], prompt_passes[n, False]
        print(f"{'':<18} {min(n, most):>7} {graph * 1e3:>9.3f} {eager * 1e3:>8.3f} {eager / graph:>12.2f}")


if __name__ == "__main__":
    main()
