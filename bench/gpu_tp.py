"""Tensor-parallel ranks on GPUs: `lanes serve --tp N` beside `--tp 1`, as real server processes.

    python bench/gpu.py --tp 2 [--streams 1,64] [--prompt 128] [--new 128]

The Qwen2.5-0.5B-shaped model of bench/gpu.py (random bf16 weights, seed 0), with a word-level tokenizer
covering the whole vocabulary so that token strings name token ids. Every contender serves HTTP on its own
port; the same client drives each. Prints one table: greedy tokens of --tp N against --tp 1, tokens/s at
each stream count, the time the collectives of one decode step take on the same group, and how each end
went (a follower killed, rank 0 killed, SIGTERM to the launcher) with its exit codes, seconds and the GPU
memory still held afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import trio

from lanes.gpu.ranks import NO_MULTICAST

ENV = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def word_tokenizer(folder: Path, vocab: int) -> None:
    """t0 .. t{vocab-1}: decoded text names each token, so greedy runs compare exactly through HTTP."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))


class Server:
    """One `python -m lanes serve` process; its stderr collected by a thread, its URL from the serving line."""

    def __init__(self, folder: Path, *flags: str, name: str) -> None:
        self.name = name
        command = [sys.executable, "-m", "lanes", "serve", "--model", str(folder), "--port", "0", "--lanes", "64",
                   "--max-model-len", "512", "--max-rows", "4096", "--prompt-cache-bytes", "0", *flags]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=ENV)
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line.rstrip())
            if self.url is None and "INFO lanes: serving " in line:
                self.url = line.rsplit(" on ", 1)[1].strip()
                self._ready.set()
        self._ready.set()

    def ready(self, timeout: float = 300) -> str:
        self._ready.wait(timeout)
        if self.url is None:
            raise RuntimeError(f"{self.name} did not serve:\n" + "\n".join(self.lines[-20:]))
        return self.url

    def wait(self, timeout: float) -> tuple[int | None, float]:
        """(exit code or None if still running after `timeout`, seconds waited)."""
        began = time.perf_counter()
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.perf_counter() - began

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            if self.wait(60)[0] is None:
                self.process.kill()
                self.process.wait()


async def load(url: str, prompts: list[list[int]], new: int, logprobs: bool = False) -> tuple[float, float, list]:
    """(tokens/s, mean time to first token, each stream's token strings) for `prompts` as concurrent streams."""
    import httpx

    firsts, produced, tokens = [], 0, [None] * len(prompts)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 8)) as http:

        async def one(i: int, prompt: list[int]) -> None:
            nonlocal produced
            start, first, seen = time.perf_counter(), None, []
            body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, **({"logprobs": 0} if logprobs else {})}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None:
                        first = time.perf_counter() - start
                    if chunk.get("usage"):
                        produced += chunk["usage"]["completion_tokens"]
                    for choice in chunk["choices"]:
                        if choice.get("logprobs"):
                            seen += choice["logprobs"]["tokens"]
            firsts.append(first)
            tokens[i] = seen

        began = time.perf_counter()
        async with trio.open_nursery() as clients:
            for i, prompt in enumerate(prompts):
                clients.start_soon(one, i, prompt)
        took = time.perf_counter() - began
    assert produced == new * len(prompts), produced
    return produced / took, statistics.mean(firsts), tokens


def gpu_memory_held() -> str:
    """Compute processes still holding GPU memory, as nvidia-smi lists them ('' when none)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return "n/a (no nvidia-smi)"
    others = [line for line in out.splitlines() if line and line.split(",")[0].strip() != str(os.getpid())]
    return "; ".join(others)  # this benchmark's own process holds a context, and is not a rank


def collective_times(world: int, counts: list[int], hidden: int, vocab: int, layers: int) -> dict[int, float]:
    """Seconds the collectives of one decode step take (1 + 2 a layer all-reduces, one logits all-gather)."""
    import torch.multiprocessing as mp

    from lanes.launch import free_port

    port = free_port()
    out = mp.get_context("spawn").Manager().dict()
    mp.spawn(_collective_rank, args=(world, port, counts, hidden, vocab, layers, out), nprocs=world, join=True)
    return dict(out)


def _collective_rank(rank, world, port, counts, hidden, vocab, layers, out) -> None:
    from lanes.gpu.ranks import RankSpec, join, leave

    device = torch.device(f"cuda:{rank}")
    comm, _ = join(RankSpec(world, rank, "127.0.0.1", port), device)
    for n in counts:
        rows = torch.randn(n, hidden, device=device, dtype=torch.bfloat16)
        local = torch.randn(n, -(-vocab // world), device=device, dtype=torch.bfloat16)

        def step():
            for _ in range(1 + 2 * layers):
                comm.all_reduce(rows)
            comm.all_gather(local, dim=-1)

        for _ in range(3):
            step()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        if rank == 0:
            out[n] = statistics.median(times)
    leave()


def first_token(server: Server, prompt: list[int], new: int):
    """Start one long stream in a thread; returns (thread, result box) once its first token has arrived."""
    import httpx

    arrived, box = threading.Event(), {}

    def run():
        body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True}
        chunks = []
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        arrived.set()
        except httpx.HTTPError as error:
            box["error"] = type(error).__name__
        box["chunks"] = chunks
        arrived.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    arrived.wait(120)
    return thread, box


def client_saw(box: dict) -> str:
    if "error" in box:
        return f"connection {box['error']}"
    last = box["chunks"][-1] if box.get("chunks") else {}
    if "error" in last:
        return f"error {last['error']['code']}"
    reasons = [c["finish_reason"] for c in last.get("choices", [])]
    return f"finished {reasons[0] if reasons else '?'}"


def ends(folder: Path, world: int, prompt: list[int]) -> list[tuple[str, str, str, str, str]]:
    """Each way the ranks end: (case, what the client saw, exit codes, seconds to the last exit, memory held)."""
    from lanes.launch import free_port

    rows = []
    for case in ("kill rank 1", "kill rank 0"):
        port = str(free_port())
        ranks = [Server(folder, "--tp", str(world), "--rank", str(r), "--master", "127.0.0.1", "--master-port", port,
                        name=f"rank {r}") for r in range(world)]
        ranks[0].ready()
        thread, box = first_token(ranks[0], prompt, 380)  # within --max-model-len 512
        victim, survivor = (ranks[1], ranks[0]) if case == "kill rank 1" else (ranks[0], ranks[1])
        victim.process.kill()
        victim.process.wait()
        code, seconds = survivor.wait(60)
        thread.join(60)
        for r in ranks:
            r.stop()
        rows.append((case, client_saw(box), f"{victim.process.returncode}/{code}", f"{seconds:.2f}",
                     gpu_memory_held() or "none"))
        say(f"  {case}: the survivor's last words: {survivor.lines[-3:]}")
    launcher = Server(folder, "--tp", str(world), name="launcher")
    launcher.ready()
    thread, box = first_token(launcher, prompt, 200)
    launcher.process.send_signal(signal.SIGTERM)
    code, seconds = launcher.wait(60)
    thread.join(60)
    statuses = [line.rsplit(" ", 1)[1] for line in launcher.lines if "exited with status" in line]
    rows.append(("SIGTERM launcher", client_saw(box), f"{code}/{','.join(statuses)}", f"{seconds:.2f}",
                 gpu_memory_held() or "none"))
    return rows


def main_tp(args, build, shape: dict) -> None:
    import tempfile

    world = args.tp
    counts = [int(n) for n in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        say("building the model ...")
        build(folder)
        torch.cuda.empty_cache()
        word_tokenizer(folder, shape["vocab_size"])
        generator = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, shape["vocab_size"], (max(counts), args.prompt), generator=generator).tolist()
        rows, greedy = [], {}
        contenders = [("--tp 1", ["--tp", "1"]), ("--tp 1 eager", ["--tp", "1", "--no-graphs"]),
                      (f"--tp {world}", ["--tp", str(world)])]
        checks = [("--tp 1 fp32", ["--tp", "1", "--dtype", "fp32"]), (f"--tp {world} fp32", ["--tp", str(world), "--dtype", "fp32"])]
        for name, flags in contenders + checks:
            say(f"starting {name} ...")
            server = Server(folder, *flags, name=name)
            try:
                url = server.ready()
                trio.run(load, url, prompts[:2], 4)  # warm-up
                greedy[name] = trio.run(load, url, prompts[:4], 32, True)[2]
                for n in counts if (name, flags) in contenders else []:
                    rate, ttft, _ = trio.run(load, url, prompts[:n], args.new)
                    rows.append((name, n, rate, ttft))
                    say(f"  {name} at {n}: {rate:.0f} tok/s, ttft {ttft * 1e3:.1f} ms")
            finally:
                server.stop()
        say("timing the collectives ...")
        collectives = collective_times(world, counts, shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"])
        say("ending the ranks every way ...")
        endings = ends(folder, world, prompts[0])
    same = greedy[f"--tp {world} fp32"] == greedy["--tp 1 fp32"]
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(greedy[f"--tp {world}"], greedy["--tp 1"])]
    print(f"\nQwen2.5-0.5B shape, bf16, {world} x {torch.cuda.get_device_name()}, prompt {args.prompt}, new {args.new}, "
          f"greedy, through HTTP")
    print(f"greedy tokens of --tp {world} equal --tp 1's in fp32 (4 prompts x 32 tokens): {same}; "
          f"in bf16, tokens equal before the first difference: {agree}")
    print(f"{'contender':<14} {'streams':>7} {'tok/s':>9} {'ttft ms':>8} {'x --tp 1':>9} {'x eager':>8} {'step ms':>8} "
          f"{'collectives ms':>14}")
    base = {n: r for name, n, r, _ in rows if name == "--tp 1"}
    eager = {n: r for name, n, r, _ in rows if name == "--tp 1 eager"}
    for name, n, rate, ttft in rows:
        coll = f"{collectives[n] * 1e3:.3f}" if name == f"--tp {world}" else ""
        print(f"{name:<14} {n:>7} {rate:>9.0f} {ttft * 1e3:>8.1f} {rate / base[n]:>9.2f} {rate / eager[n]:>8.2f} "
              f"{n / rate * 1e3:>8.3f} {coll:>14}")
    print(f"\n{'end':<18} {'client saw':<22} {'exit codes':<12} {'seconds':>8}  GPU memory held after")
    for case, saw, codes, seconds, held in endings:
        print(f"{case:<18} {saw:<22} {codes:<12} {seconds:>8}  {held}")
