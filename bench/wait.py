"""How the worker thread waits for a pass's end: a sleeping event, a spinning one, or torch's, in one run.

    python bench/wait.py [--lanes 1,64] [--context 192]

On the Qwen2.5-0.5B-shaped model of bench/gpu.py: one decode pass (graph replay, greedy draw, the
read-back into page-locked memory, the wait) timed on the host for each way of waiting, beside the replay
alone (device time, CUDA events); then the engine's tokens/s (128-token prompts, `--new` tokens, greedy)
with each, the ways taken in turn, twice. A last column shows whether the wait lets another Python thread
run: iterations a counting thread made while the worker waited for a 20 ms GPU sleep, per millisecond.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import trio  # noqa: E402
from gpu import build, run_engine, step_times  # noqa: E402

from lanes.backend.torch_backend import TorchBackend  # noqa: E402
from lanes.gpu.device import CudaRunner, choose  # noqa: E402
from lanes.loader import load_model  # noqa: E402


def counted_while_waiting(runner: CudaRunner) -> float:
    """Iterations a second thread makes per millisecond while this one waits on a 20 ms GPU sleep."""
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    with torch.cuda.stream(runner.torch_stream):
        torch.cuda._sleep(int(20e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3))
        event = runner.record()
    began, before = time.perf_counter(), count[0]
    event.sync()
    event.close()
    took, counted = time.perf_counter() - began, count[0] - before
    stop.set()
    thread.join()
    return counted / (took * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lanes", default="1,64")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    lanes = [int(n) for n in args.lanes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        print("building the model ...", file=sys.stderr, flush=True)
        build(Path(tmp))  # the transformers copy is dropped here; the loader reads the saved weights
        torch.cuda.empty_cache()
        model = load_model(Path(tmp), choose("cuda", "bf16"), kv_blocks=max(lanes) * 32, quiet=True)
    runner = CudaRunner(0)
    backend = TorchBackend(model, runner, lanes=max(lanes), max_model_len=1024)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (max(lanes), 128), generator=generator).tolist()
    rows, rates = [], {w: {n: [] for n in lanes} for w in CudaRunner.WAITS}
    for wait in CudaRunner.WAITS:
        runner.wait = wait
        times = {n: step_times(backend, n, args.context) for n in lanes}
        others = statistics.median(counted_while_waiting(runner) for _ in range(3))
        rows.append((wait, times, others))
    for _ in range(2):
        for wait in CudaRunner.WAITS:
            runner.wait = wait
            for n in lanes:
                rates[wait][n].append(trio.run(run_engine, backend, model, prompts[:n], args.new)[0])
    print(f"\none decode pass of the Qwen2.5-0.5B shape at {args.context} tokens, {torch.cuda.get_device_name()} (ms)")
    header = "".join(f"{f'{n} lanes replay':>16}{f'{n} lanes pass':>15}" for n in lanes)
    engine = "".join(f"{f'{n} streams tok/s':>18}" for n in lanes)
    print(f"{'wait':>6}{header}{engine}{'other thread /ms':>18}")
    for wait, times, others in rows:
        cells = "".join(f"{times[n][0] * 1e3:>16.3f}{times[n][1] * 1e3:>15.3f}" for n in lanes)
        tok = "".join(f"{'/'.join(f'{r:.0f}' for r in rates[wait][n]):>18}" for n in lanes)
        print(f"{wait:>6}{cells}{tok}{others:>18.0f}")


if __name__ == "__main__":
    main()
