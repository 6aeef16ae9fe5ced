"""The CPU benchmark: lanes beside llama.cpp (llama-cpp-python) and transformers, same GGUF, same prompts.

    python bench/cpu.py [--model M] [--prompt-len 64] [--new 64] [--streams 1,8] [--rounds 3]
                        [--llama-python PY]

One command: the first run makes bench/.venv-llamacpp (ignored by git) and builds llama-cpp-python 0.3.36
in it (about 10 minutes on 2 cores; the CPU's own kernels without AMX, see GGML_FLAGS), unless
`--llama-python` names a Python that has it; it is never a dependency of lanes. Each contender is a worker process that loads the model once, then answers
requests: greedy, end-of-sequence ignored, the same random prompts of `--prompt-len` tokens to all, `--new`
tokens a stream. lanes runs N concurrent streams on its lane core; transformers runs generate() on a batch
of N; llama.cpp runs batch 1 only, the figure the issue's bar compares with. Rounds are interleaved (every
configuration once a round) and the figure is the median round; each run starts a second after the one before, once the idle workers' OpenMP
threads have stopped spinning. tok/s counts prompt and new tokens of every stream over the wall time.

Memory: each worker imports its libraries, then reads its resident memory from /proc before the load,
after it, and after its runs (the growth is the model's memory: weights, KV cache, vocabulary, buffers).
llama.cpp holds one stream's context (`n_ctx` = prompt + new + 16 tokens, f16); lanes' speed worker holds
the KV of max(streams) lanes, so one more lanes worker, KV for one stream of the same context, is
measured beside it (it runs one 1-stream generation first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTLE = 1.0  # seconds between runs: the last contender's OpenMP threads spin on after it (libgomp's default)
ENVIRONMENT = dict(os.environ)  # as given, before lanes is imported (it sets its own OpenMP wait policy)
LLAMA_VENV = HERE / ".venv-llamacpp"
LLAMA_CPP = "llama-cpp-python==0.3.36"
# ggml's x86 kernels this CPU has (its /proc/cpuinfo flags), but not AMX: its AMX matmul died with SIGILL on
# an Intel host here (a tileloadd in a worker thread); a kernel the CPU lacks (AVX-VNNI on AMD) dies the same way
GGML_FLAGS = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
              "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AVX_VNNI": "avx_vnni"}


def llama_cmake_args() -> str:
    flags = set(next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), []))
    return " ".join(["-DGGML_NATIVE=OFF"] + [f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for name, flag in GGML_FLAGS.items()])


def rss_mb() -> float:
    """This process's resident memory now, from /proc (MB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---- workers: one a contender, JSON lines on stdin/stdout -------------------------------------------


def worker_lanes(model: str, lanes: int, context: int):
    import lanes as _lanes  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads libgomp)
    import torch
    import trio

    from lanes.core.lane_core import LaneCore
    from lanes.core.sampling import SamplingParams
    from lanes.core.stream import Finished, Request, TokenEvent
    from lanes.backend.torch_backend import TorchBackend, text_factory
    from lanes.core.blocks import blocks_for
    from lanes.gpu.device import choose, runner_for
    from lanes.loader import load_model
    from lanes.quant.native import kernels
    from lanes.text import tokenizer  # noqa: F401  (libraries in before the load, as llama_cpp's are)

    kernels()
    placement = choose("cpu", "auto")
    before = rss_mb()
    loaded = load_model(Path(model), placement, kv_blocks=lanes * blocks_for(context), quiet=True)
    loaded_mb = rss_mb() - before

    def generate(prompts: list[list[int]], new: int) -> tuple[float, list[int]]:
        first: list[int] = []

        async def run() -> float:
            backend = TorchBackend(loaded, runner_for(placement), lanes=lanes, max_model_len=context)
            core = LaneCore(backend, text_factory(loaded.tokenizer), loaded.tokenizer.eos_ids, max_rows=512)

            async def one(index: int, prompt: list[int]) -> None:
                sampling = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
                stream = await core.submit(Request(tuple(prompt), sampling))
                async for event in stream.events:
                    if index == 0 and isinstance(event, TokenEvent):
                        first.append(event.token)
                    if isinstance(event, Finished):
                        assert event.completion_tokens == new

            async with trio.open_nursery() as nursery:
                await nursery.start(core.run)
                start = time.perf_counter()
                async with trio.open_nursery() as clients:
                    for i, prompt in enumerate(prompts):
                        clients.start_soon(one, i, prompt)
                took = time.perf_counter() - start
                await core.shutdown(0)
            return took

        return trio.run(run), first

    info = {"rss_mb": loaded_mb, "before_mb": before, "threads": torch.get_num_threads(), "version": "lanes (this tree)"}
    return info, generate


def worker_transformers(model: str, lanes: int, context: int):
    import torch
    import transformers

    from lanes.gpu.device import choose
    from bench_reference import reference_model

    before = rss_mb()
    reference = reference_model(Path(model), choose("cpu", "auto"))
    loaded_mb = rss_mb() - before

    def generate(prompts: list[list[int]], new: int) -> tuple[float, list[int]]:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, pad_token_id=0)
        return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()

    info = {"rss_mb": loaded_mb, "before_mb": before, "threads": torch.get_num_threads(),
            "version": f"transformers {transformers.__version__}"}
    return info, generate


def worker_llamacpp(model: str, lanes: int, context: int):
    import llama_cpp

    before = rss_mb()
    llm = llama_cpp.Llama(model_path=model, n_ctx=context, n_batch=context, n_threads=os.cpu_count(), verbose=False)
    loaded_mb = rss_mb() - before

    def generate(prompts: list[list[int]], new: int) -> tuple[float, list[int]]:
        first: list[int] = []
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):  # batch 1: one stream after another
            llm.reset()
            for n, token in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True)):
                if i == 0:
                    first.append(token)
                if n + 1 == new:
                    break
        return time.perf_counter() - start, first

    info = {"rss_mb": loaded_mb, "before_mb": before, "threads": os.cpu_count(),
            "version": f"llama-cpp-python {llama_cpp.__version__}"}
    return info, generate


WORKERS = {"lanes": worker_lanes, "transformers": worker_transformers, "llama.cpp": worker_llamacpp}


def serve_worker(kind: str, model: str, lanes: int, context: int) -> None:
    """Load, say so with the load's facts, then answer one generation a line until stdin closes."""
    out = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints must not interleave with the replies
    info, generate = WORKERS[kind](model, lanes, context)
    out.write(json.dumps(info) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("memory"):
            out.write(json.dumps({"rss_mb": rss_mb() - info["before_mb"]}) + "\n")
        else:
            seconds, tokens = generate(request["prompts"], request["new"])
            out.write(json.dumps({"seconds": seconds, "tokens": tokens}) + "\n")
        out.flush()


# ---- the driver ---------------------------------------------------------------------------------------


class Worker:
    def __init__(self, kind: str, python: str, model: Path, lanes: int, context: int) -> None:
        self.kind = kind
        cmd = [python, __file__, "--worker", kind, "--model", str(model), "--lanes", str(lanes), "--context", str(context)]
        # each contender as it runs by itself: lanes' worker sets its own environment when it imports lanes
        env = dict(ENVIRONMENT, PYTHONPATH=os.pathsep.join([str(HERE), ENVIRONMENT.get("PYTHONPATH", "")]))
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.kind} worker ended (see its error above)")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], new: int) -> dict:
        self.process.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def resident_mb(self) -> float:
        """The worker's resident memory now, over what it held before its load."""
        self.process.stdin.write(json.dumps({"memory": True}) + "\n")
        self.process.stdin.flush()
        return self._read()["rss_mb"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def llama_python(given: str | None) -> str:
    """A Python with llama-cpp-python: the one given, else bench/.venv-llamacpp, made the first time."""
    if given:
        return given
    python = LLAMA_VENV / "bin" / "python"
    if not python.exists():
        print(f"building {LLAMA_CPP} in {LLAMA_VENV} (once; about 10 minutes on 2 cores) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(LLAMA_VENV)], check=True)
        env = dict(os.environ, CMAKE_ARGS=llama_cmake_args())
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-cache-dir", LLAMA_CPP], check=True, env=env)
    return str(python)


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-python", default=None)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--lanes", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return serve_worker(args.worker, args.model, args.lanes, args.context)

    import torch

    from lanes.models import resolve_model

    path = resolve_model(args.model)
    counts = [int(n) for n in args.streams.split(",")]
    context = args.prompt_len + args.new + 16
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 49152 if path.suffix == ".gguf" else 32000, (max(counts), args.prompt_len), generator=generator).tolist()
    print("starting the workers (each loads the model) ...", file=sys.stderr)
    workers = {
        "lanes": Worker("lanes", sys.executable, path, max(counts), context),
        "llama.cpp": Worker("llama.cpp", llama_python(args.llama_python), path, 1, context),
        "transformers": Worker("transformers", sys.executable, path, max(counts), context),
    }
    configs = [(kind, n) for n in counts for kind in workers if kind != "llama.cpp" or n == 1]
    times: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    firsts: dict[tuple[str, int], list[int]] = {}
    for kind, n in configs:  # warm-up: one generation each, not timed
        workers[kind].generate(prompts[:n], args.new)
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds} ...", file=sys.stderr)
        for kind, n in configs:
            time.sleep(SETTLE)
            reply = workers[kind].generate(prompts[:n], args.new)
            times[(kind, n)].append(reply["seconds"])
            firsts[(kind, n)] = reply["tokens"]
    after = {kind: w.resident_mb() for kind, w in workers.items()}
    print("the memory of lanes with one stream's KV ...", file=sys.stderr)
    one = Worker("lanes", sys.executable, path, 1, context)
    one.generate(prompts[:1], args.new)
    memory = [(f"lanes", f"{max(counts)} x {context}", workers["lanes"].info["rss_mb"], after["lanes"]),
              ("lanes", f"1 x {context}", one.info["rss_mb"], one.resident_mb()),
              ("llama.cpp", f"1 x {context} (f16)", workers["llama.cpp"].info["rss_mb"], after["llama.cpp"]),
              ("transformers", "its own", workers["transformers"].info["rss_mb"], after["transformers"])]
    for w in [*workers.values(), one]:
        w.close()

    per_stream = args.prompt_len + args.new
    rate = {c: c[1] * per_stream / statistics.median(t) for c, t in times.items()}
    llama1 = rate[("llama.cpp", 1)]
    print(f"\n{machine()}; torch {torch.__version__}; {workers['llama.cpp'].info['version']}, "
          f"{workers['transformers'].info['version']}")
    print(f"model {path.name}; greedy; prompt {args.prompt_len} + new {args.new} tokens a stream, prompt included; "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'contender':<13} {'streams':>7} {'tok/s':>8} {'x llama.cpp@1':>14} {'same tokens as llama.cpp':>25}")
    for (kind, n) in configs:
        same = firsts[(kind, n)] == firsts[("llama.cpp", 1)]
        print(f"{kind:<13} {n:>7} {rate[(kind, n)]:>8.1f} {rate[(kind, n)] / llama1:>14.2f} {str(same):>25}")
    llama_after = memory[2][3]
    print(f"\nresident memory over the worker's before its load (libraries imported), MB")
    print(f"{'contender':<13} {'KV for (lanes x tokens)':>24} {'after load':>11} {'after runs':>11} {'x llama.cpp':>12}")
    for kind, kv, loaded_mb, after_mb in memory:
        print(f"{kind:<13} {kv:>24} {loaded_mb:>11.1f} {after_mb:>11.1f} {after_mb / llama_after:>12.2f}")


if __name__ == "__main__":
    main()
