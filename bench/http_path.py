"""The HTTP path beside the engine in process, in one run: tokens/s, time to first token, and the server's
CPU time a streamed token.

    python bench/http_path.py [--streams 64,256] [--new 128] [--prompt 16] [--pass-ms 2] [--runs 3] [--stream-writers N]
    python bench/http_path.py --model PATH|random --device cuda [--streams 64] [--prompt 128] [--new 128]

Without `--model` the engine runs on a stand-in device whose every pass takes `--pass-ms` of wall time
(the event loop runs on meanwhile, as it does while the GPU works) and draws fixed tokens at no cost: the
fake backend of the tests reads each lane's whole context back every pass (~90 us of CPU a token here),
which would be measured as the server's cost. Its passes end as a GPU's do: polled once a scheduling round
and waited for in a worker thread when the loop would block (the CUDA backend's `PassWaiter`), not with
`trio.sleep`, whose wake epoll rounds up to the next whole millisecond (a 2 ms pass then ended 0.35 ms late
in process and 1 ms late through HTTP). With `--model` it is that model on the device (CUDA graphs).

Each setting runs the same streams twice: in process (one task a stream reading its events) and through
the OpenAI API (streaming completions, `ignore_eos`, from client processes of their own that read the SSE
bytes with minimal parsing: the first `data: {` is the first token, the usage chunk gives the count).
`cpu us/tok` is the server's CPU time (this process's every thread, user and system, and its stream
writers' with `--stream-writers`; `sys` the system part, `loop` this process's alone) over the run, a
streamed token, the least of the runs (other work on the host only ever adds to it); tokens/s and first
tokens are the median run's; `http us/tok` is
what the HTTP path adds to it (through HTTP less in process): the server's own cost a token. `served ttft`
is the first token as the server saw it (from the request's head to its first event, its /metrics
histogram): the rest of `ttft` is the clients' own time and the sockets'.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import resource
import selectors
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from lanes.core.backend import BackendShape
from lanes.core.lane_core import LaneCore
from lanes.core.plan import PassResult, Sampled
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Finished, Request, TokenEvent
from lanes.gpu.polling import PassWaiter
from lanes.heap import freeze_startup_heap

VOCAB = 256
LETTERS = b"abcdefghijklmnopqrstuvwxyz "  # the stand-in device's tokens: bytes, each its own character


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Due:
    """A stand-in pass in flight (`lanes.gpu.polling.Polled`): done at a time, its wait a thread's sleep."""

    waits = True

    def __init__(self, at: float) -> None:
        self.at = at

    def done(self) -> bool:
        return time.perf_counter() >= self.at

    def wait(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))

    def read(self) -> None:
        return None

    def result(self) -> None:
        self.wait()


class FixedPass:
    """A stand-in device: every pass takes `seconds` from when it is handed over; tokens depend on the lane
    and the step only (so drawing them costs nothing the server's cost would hide in)."""

    def __init__(self, seconds: float, lanes: int, max_model_len: int) -> None:
        self.seconds, self.passes = seconds, 0
        self.shape = BackendShape(lanes, lanes * (max_model_len // 16 + 1) + 16, 16, VOCAB, max_model_len)
        self._waiter, self._limiter = PassWaiter(), trio.CapacityLimiter(1)

    async def step(self, plan, started=None, following=None) -> PassResult:
        self.passes += 1
        due = Due(time.perf_counter() + self.seconds)
        if started is not None:
            started()
        await self._waiter.collect(due, self._limiter)
        return PassResult(tuple(Sampled((LETTERS[(plan.step * 7 + w.piece.lane) % len(LETTERS)],)) if w.sample else None
                                for w in plan.work), tuple(None for _ in plan.work))

    def bind(self, *args) -> None:
        pass

    def unbind(self, lane: int) -> None:
        pass

    async def aclose(self) -> None:
        pass


def byte_tokenizer(folder: Path):
    """A byte-level BPE of the 256 bytes in byte order (id = byte), as real models' tokenizers are byte-level:
    its text streams from the detokenizer's table of bytes, with no decode call."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

    from lanes.text.tokenizer import Tokenizer

    stand_in = byte_alphabet()
    words = Backend(models.BPE(vocab={c: b for b, c in enumerate(stand_in)}, merges=[]))
    words.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words.decoder = decoders.ByteLevel()
    words.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": stand_in[1]}))
    return Tokenizer.from_folder(folder, VOCAB)


def random_model(folder: Path) -> Path:
    """bench/gpu.py's Qwen2.5-0.5B-shaped model (random bf16 weights, a fixed seed), saved once, with a byte-level
    tokenizer over its whole vocabulary (the 256 bytes, then strings of letters), so that every token it
    draws has text, and a chat of its own streams."""
    import importlib.util
    import itertools
    import string

    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

    target = folder / "random-qwen"
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.spec_from_file_location("bench_gpu", Path(__file__).with_name("gpu.py"))
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    say("building the random model ...")
    gpu.build(target)
    vocab = {c: i for i, c in enumerate(byte_alphabet())}
    words = (("".join(w) for w in itertools.product(string.ascii_lowercase, repeat=k)) for k in range(2, 5))
    for word in itertools.chain.from_iterable(words):
        if len(vocab) == gpu.SHAPE["vocab_size"]:
            break
        vocab[word] = len(vocab)
    text = Backend(models.BPE(vocab=vocab, merges=[]))
    text.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text.decoder = decoders.ByteLevel()
    text.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": byte_alphabet()[1]}))
    return target


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


class Setup:
    """The backend, tokenizer and prompts every run of a setting shares."""

    def __init__(self, args, streams: int, folder: Path) -> None:
        self.streams, self.new = streams, args.new
        context = args.prompt + args.new + 16
        if args.model is None:
            self.backend = FixedPass(args.pass_ms / 1e3, streams, context)
            self.tokenizer, self.family, self.vocab = byte_tokenizer(folder), "fake", VOCAB
        else:
            from lanes.backend.torch_backend import TorchBackend
            from lanes.core.blocks import blocks_for
            from lanes.gpu.device import choose, runner_for
            from lanes.loader import load_model

            path = random_model(folder) if args.model == "random" else Path(args.model)
            say(f"loading {path} ...")
            placement = choose(args.device, args.dtype)
            model = load_model(path, placement, kv_blocks=streams * blocks_for(context) + 16)
            self.backend = TorchBackend(model, runner_for(placement), lanes=streams, max_model_len=context)
            self.tokenizer, self.family, self.vocab = model.tokenizer, model.config.family, model.config.vocab_size
        self.prompts = [[(7 * i + 13 * j) % (self.vocab - 2) + 2 for j in range(args.prompt)] for i in range(streams)]

    def core(self) -> LaneCore:
        from lanes.backend.torch_backend import text_factory

        return LaneCore(self.backend, text_factory(self.tokenizer), [], max_rows=8192, max_queue=4096)


def cpu_times(since: tuple[float, float, float] = (0.0, 0.0, 0.0), pids=()) -> tuple[float, float, float]:
    """(user + system, system, this process's user + system) CPU seconds of this process, every thread, and
    of the processes `pids` (the server's stream writers), since `since`. This process's in microseconds
    (getrusage; `os.times` counts 10 ms ticks, 1.2 us a token over 64 x 128); the writers' in ticks."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    user, system = usage.ru_utime, usage.ru_stime
    own = user + system
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        user, system = user + int(fields[11]) / tick, system + int(fields[12]) / tick
    return user + system - since[0], system - since[1], own - since[2]


async def in_process(setup: Setup) -> tuple[float, float, tuple[float, float], None]:
    """(tokens/s, mean time to first token, CPU seconds, None) of the streams on the lane core directly."""
    core = setup.core()
    sampling = SamplingParams(temperature=0, max_tokens=setup.new, ignore_eos=True)
    firsts, produced = [], 0

    async def one(prompt) -> None:
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
        began, cpu = time.perf_counter(), cpu_times()
        async with trio.open_nursery() as clients:
            for prompt in setup.prompts:
                clients.start_soon(one, prompt)
        took, cpu = time.perf_counter() - began, cpu_times(cpu)
        await core.shutdown(0)
    core.check_integrity()
    assert produced == setup.new * setup.streams, produced
    return produced / took, statistics.mean(firsts), cpu, None


async def through_http(setup: Setup, processes: int, writers: int = 0) -> tuple[float, float, tuple[float, float], float]:
    """(tokens/s, mean time to first token, CPU seconds, the mean first token as the server saw it: from
    the request's head to its first token's event) of the same streams through the server, with `writers`
    stream writer processes (their CPU counted as the server's)."""
    from lanes.http.service import Service
    from lanes.runtime import Runtime

    core = setup.core()
    service = Service(core, setup.tokenizer, "bench", setup.family, setup.backend.shape.max_model_len,
                      vocab_size=setup.vocab, max_open=setup.streams + 64, stream_writers=writers)
    runtime = Runtime(service, port=0)
    spawn = multiprocessing.get_context("spawn")
    go, pipes, children = spawn.Event(), [], []
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(runtime.run)
        pids = runtime.writers.pids if runtime.writers is not None else []
        passes = setup.backend.passes if isinstance(setup.backend, FixedPass) else 0
        for i in range(processes):
            receive, send = spawn.Pipe(duplex=False)
            children.append(spawn.Process(target=clients, args=(listening.port, setup.prompts[i::processes],
                                                                setup.new, send, go)))
            children[-1].start()
            send.close()  # a child that dies ends the parent's wait with EOFError
            pipes.append(receive)
        try:
            replies = [await trio.to_thread.run_sync(pipe.recv) for pipe in pipes]  # each "ready" or its failure
            cpu = cpu_times(pids=pids)
            go.set()  # every child has connected: they send together
            if all(kind == "ready" for kind, _ in replies):
                replies = [await trio.to_thread.run_sync(pipe.recv) for pipe in pipes]
            cpu = cpu_times(cpu, pids)
            if pids and passes is not None and isinstance(setup.backend, FixedPass):
                messages = sum(link.messages for link in runtime.writers.links)
                say(f"  {messages} messages to the writers over {setup.backend.passes - passes} passes")
        finally:
            go.set()
            for child in children:
                await trio.to_thread.run_sync(child.join)
            runtime.request_stop()
    core.check_integrity()
    failures = [value for kind, value in replies if kind != "ok"]
    if failures:
        raise RuntimeError(f"the HTTP clients failed: {failures[0]}")
    produced = sum(value[0] for _, value in replies)
    assert produced == setup.new * setup.streams, produced
    began, ended = min(value[1] for _, value in replies), max(value[2] for _, value in replies)
    sample = service.metrics.registry.get_sample_value
    labels = {"model_name": "bench"}
    served = sample("lanes_time_to_first_token_seconds_sum", labels) / sample("lanes_time_to_first_token_seconds_count", labels)
    return produced / (ended - began), statistics.mean(t for _, value in replies for t in value[3]), cpu, served


USAGE = re.compile(rb'"completion_tokens": ?(\d+)')
END = b"\r\n0\r\n\r\n"  # the chunked body's last chunk


def clients(port: int, prompts, new: int, results, go) -> None:
    """In a child process: one connection a prompt, each a streaming completion sent once `go` is set,
    read with a selector; sends ("ready", None), then ("ok", (tokens, began, ended, first-token times))
    or ("error", why)."""
    try:
        sockets = [socket.create_connection(("127.0.0.1", port)) for _ in prompts]
        requests = []
        for prompt in prompts:
            body = json.dumps({"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
                               "stream": True, "stream_options": {"include_usage": True}}).encode()
            requests.append(b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n%s" % (len(body), body))
        results.send(("ready", None))
        go.wait()
        selector = selectors.DefaultSelector()
        received, firsts, starts = [bytearray() for _ in prompts], [None] * len(prompts), [0.0] * len(prompts)
        for i, (sock, request) in enumerate(zip(sockets, requests)):
            starts[i] = time.perf_counter()
            sock.sendall(request)
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, i)
        began, left = min(starts), len(prompts)
        while left:
            for key, _ in selector.select():
                i, data = key.data, key.fileobj.recv(1 << 16)
                if not data:
                    raise ConnectionError(f"the server closed stream {i}'s connection mid-answer")
                buffer = received[i]
                buffer += data
                if firsts[i] is None and b"data: {" in buffer:
                    firsts[i] = time.perf_counter() - starts[i]
                if buffer.endswith(END):
                    selector.unregister(key.fileobj)
                    left -= 1
        ended = time.perf_counter()
        tokens = 0
        for buffer in received:
            if not buffer.startswith(b"HTTP/1.1 200"):
                raise ConnectionError(f"answer {bytes(buffer[:200])!r}")
            tokens += int(USAGE.findall(buffer)[-1])
        for sock in sockets:
            sock.close()
        results.send(("ok", (tokens, began, ended, firsts)))
    except Exception as error:  # reported to the parent, which raises it
        results.send(("error", f"{type(error).__name__}: {error}"))


def profiled(path: str | None, run, *args):
    """`trio.run(run, *args)`, under cProfile when `path` is given (its stats written there)."""
    if path is None:
        return trio.run(run, *args)
    import cProfile

    profile = cProfile.Profile()
    try:
        return profile.runcall(trio.run, run, *args)
    finally:
        profile.dump_stats(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--pass-ms", type=float, default=2.0, help="the stand-in device's pass (without --model)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each setting, interleaved; the median is shown")
    parser.add_argument("--clients", type=int, default=0, help="client processes (0: half the CPUs, 1 to 8)")
    parser.add_argument("--model", default=None, help="a model folder or GGUF file, or `random` (bench/gpu.py's "
                        "Qwen2.5-0.5B shape): run it instead of the stand-in")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--stream-writers", type=int, default=0, help="also through HTTP with this many stream "
                        "writer processes (their CPU counted as the server's)")
    parser.add_argument("--profile", default=None, help="write cProfile's stats of the server's last HTTP run here")
    args = parser.parse_args()
    processes = args.clients or max(1, min(8, (os.cpu_count() or 2) // 2))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for n in [int(s) for s in args.streams.split(",")]:
            setup = Setup(args, n, Path(folder))
            freeze_startup_heap()  # as `lanes serve` does once start-up is over
            trio.run(in_process, setup)  # warm-up: graphs, first allocations
            runs: dict[str, list] = {"in process": [], "HTTP": []}
            if args.stream_writers:
                runs[f"HTTP w{args.stream_writers}"] = []
            for i in range(args.runs):  # interleaved, so that the machine's slow spells fall on both
                say(f"{n} streams, run {i + 1} of {args.runs} ...")
                runs["in process"].append(trio.run(in_process, setup))
                runs["HTTP"].append(profiled(args.profile, through_http, setup, min(processes, n)))
                if args.stream_writers:
                    runs[f"HTTP w{args.stream_writers}"].append(trio.run(through_http, setup, min(processes, n),
                                                                         args.stream_writers))
            median = {path: sorted(r)[len(r) // 2] for path, r in runs.items()}  # the median run, by tok/s
            least = {path: min((run[2] for run in r), key=lambda c: c[0]) for path, r in runs.items()}  # contention only adds CPU time
            rows.append((n, {path: (*run[:2], least[path], run[3]) for path, run in median.items()}))
    device = f"{args.model} on {args.device}" if args.model else f"a fixed {args.pass_ms:g} ms pass"
    print(f"\nthe engine on {device}; prompt {args.prompt}, {args.new} new tokens a stream, median of {args.runs} "
          f"(CPU: the least of them); {processes} client processes")
    print(f"{'streams':>7} {'path':>10} {'tok/s':>8} {'ttft ms':>8} {'cpu us/tok':>10} {'sys':>5} {'loop':>5}  "
          f"{'x tok/s':>7} {'x ttft':>7} {'http us/tok':>11} {'served ttft':>11}")
    for n, median in rows:
        (rate, ttft, (cpu, sys_cpu, own), _), tokens = median["in process"], n * args.new
        print(f"{n:>7} {'in process':>10} {rate:>8.0f} {ttft * 1e3:>8.1f} {cpu / tokens * 1e6:>10.1f} "
              f"{sys_cpu / tokens * 1e6:>5.1f} {own / tokens * 1e6:>5.1f}")
        for path in [p for p in median if p != "in process"]:
            (h_rate, h_ttft, (h_cpu, h_sys, h_own), served) = median[path]
            print(f"{n:>7} {path:>10} {h_rate:>8.0f} {h_ttft * 1e3:>8.1f} {h_cpu / tokens * 1e6:>10.1f} "
                  f"{h_sys / tokens * 1e6:>5.1f} {h_own / tokens * 1e6:>5.1f}  {h_rate / rate:>7.2f} "
                  f"{h_ttft / ttft:>7.2f} {(h_cpu - cpu) / tokens * 1e6:>11.1f} {served * 1e3:>11.1f}")


if __name__ == "__main__":
    main()
