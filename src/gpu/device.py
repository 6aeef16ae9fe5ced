"""Where passes run: CUDA when cuda-python finds a GPU, else the CPU; and how Trio awaits a pass.

On CUDA a pass is launched on a stream made with cuda-python (wrapped for torch) and its end is awaited
through a CUDA event synced in a worker thread, so the event loop never blocks; a graph's replay, cheap
to launch, is launched from the event loop itself and its end polled there (`run_inline`, gpu/polling.py).
On the CPU the pass itself runs in a worker thread. Either way one pass runs at a time, in submission order.
"""

from __future__ import annotations

from functools import partial

from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

import torch
import trio

from .polling import PassWaiter, Polled

T = TypeVar("T")

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


class DeviceError(Exception):
    """A device or dtype that cannot be used here; the words are for the person who asked for it."""


def cuda_device_count() -> int:
    """GPUs the CUDA driver sees, through cuda-python; 0 when there is no driver or no device."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, count = driver.cuDeviceGetCount()
        return int(count) if err == driver.CUresult.CUDA_SUCCESS else 0
    except (ImportError, RuntimeError, OSError):
        return 0


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        return f"{self.device} {str(self.dtype).removeprefix('torch.')}"


def choose(device: str | None = None, dtype: str | None = None) -> Placement:
    """`--device` (auto, cpu, cuda, cuda:N) and `--dtype` (auto, bf16, fp16, fp32) to a placement.

    auto picks CUDA when a GPU is there; the default dtype is bf16 on CUDA and fp32 on the CPU.
    """
    device = (device or "auto").lower()
    gpus = cuda_device_count()
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if index >= gpus:
            raise DeviceError(f"--device {device}: {gpus} CUDA device(s) found" + ("" if gpus else " (no driver or no GPU)"))
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {device}: this torch build has no CUDA support")
        target = torch.device("cuda", index)
    elif device == "cpu":
        target = torch.device("cpu")
    else:
        raise DeviceError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    name = (dtype or "auto").lower()
    if name == "auto":
        chosen = torch.bfloat16 if target.type == "cuda" else torch.float32
    elif name in DTYPES:
        chosen = DTYPES[name]
    else:
        raise DeviceError(f"--dtype {dtype}: expected auto, bf16, fp16 or fp32")
    return Placement(target, chosen)


def announced(fn: Callable[[], T], started: Callable[[], None] | None) -> Callable[[], T]:
    """`fn`, which first has `started` called in the event loop (not waited for) from its worker thread."""
    if started is None:
        return fn
    token = trio.lowlevel.current_trio_token()

    def run() -> T:
        token.run_sync_soon(started)
        return fn()

    return run


class Launched(Protocol[T]):
    """A pass put on the device's queue; `result()` waits until the device has run it and reads it back."""

    def result(self) -> T: ...


class CpuRunner:
    """Runs each pass in a worker thread, one at a time; the thread finishes its pass even if cancelled."""

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(1)

    async def run(self, fn: Callable[[], T], started: Callable[[], None] | None = None) -> T:
        return await trio.to_thread.run_sync(announced(fn, started), limiter=self._limiter)

    async def run_launched(self, launch: Callable[[], Launched[T]], started: Callable[[], None] | None = None) -> T:
        """`launch` computes the pass here (the CPU has no queue), so `started` comes first."""
        return await self.run(lambda: launch().result(), started)

    def record(self) -> None:
        """No events on the CPU: a pass is done when its launch returns."""
        return None

    def close(self) -> None:
        pass


class CudaRunner:
    """Launches each pass on a cuda-python stream from a worker thread and awaits its end via a CUDA event."""

    WAITS = ("spin", "sleep", "torch")  # how `record`'s events are waited for (bench/wait.py compares them)

    def __init__(self, index: int, wait: str = "spin") -> None:
        from cuda.core import Device, EventOptions

        self.device = Device(index)
        torch.cuda.set_device(index)
        torch.cuda.init()  # torch's primary context first, so cuda.core shares it
        self.device.set_current()
        self.stream = self.device.create_stream()
        # torch: launches on the stream made by cuda-python
        self.torch_stream = torch.cuda.ExternalStream(int(self.stream.handle), device=torch.device("cuda", index))
        self._event_options = EventOptions(timing_enabled=False, blocking_sync=True)  # the waiting thread sleeps, not spins
        self._spinning = EventOptions(timing_enabled=False, blocking_sync=False)
        if wait not in self.WAITS:
            raise ValueError(f"wait must be one of {self.WAITS}, not {wait!r}")
        self.wait = wait
        self._launcher = trio.CapacityLimiter(1)
        self._waiter = PassWaiter()

    def _launch_and_wait(self, fn: Callable[[], T]) -> T:
        with torch.cuda.stream(self.torch_stream):
            out = fn()
        event = self.stream.record(options=self._event_options)
        event.sync()  # this worker thread sleeps until the GPU has reached the event
        event.close()
        return out

    async def run(self, fn: Callable[[], T], started: Callable[[], None] | None = None) -> T:
        """The pass's result once the GPU has finished it; the event loop keeps running meanwhile.

        Launch and wait share one worker thread: one thread hop a pass instead of two. `started` is called
        in the event loop once the worker has begun the pass.
        """
        return await trio.to_thread.run_sync(announced(partial(self._launch_and_wait, fn), started), limiter=self._launcher)

    async def run_launched(self, launch: Callable[[], Launched[T]], started: Callable[[], None] | None = None) -> T:
        """`launch` puts a pass on the stream and returns at once; `started` is called once it is queued,
        so the event loop's work between passes overlaps the GPU's; then the pass's result."""
        token = trio.lowlevel.current_trio_token()

        def go() -> T:
            with torch.cuda.stream(self.torch_stream):
                pending = launch()
                if started is not None:
                    token.run_sync_soon(started)
                return pending.result()

        return await trio.to_thread.run_sync(go, limiter=self._launcher)

    async def run_inline(self, launch: Callable[[], Polled[T]], started: Callable[[], None] | None = None) -> T:
        """`launch` puts a pass on the stream from the event loop's own thread (it must be cheap: a graph
        replay) and `started` is called at once; the pass is then polled while other tasks run (settling
        the pass before, delivering its events) and read back here (`polling.PassWaiter`)."""
        with torch.cuda.stream(self.torch_stream):
            pending = launch()
        if started is not None:
            started()
        return await self._waiter.collect(pending, self._launcher)

    def record(self):
        """An event at this point of the stream, for `Launched.result` to wait on. A pass's result is
        waited for spinning: a sleeping thread woke ~0.25 ms late on the H200 (bench/wait.py)."""
        if self.wait == "torch":
            return _TorchEvent(self.torch_stream)
        return self.stream.record(options=self._spinning if self.wait == "spin" else self._event_options)

    def close(self) -> None:
        # The stream stays alive: torch's caching allocators record events on it when they free memory
        # that a pass used, possibly long after this runner is gone.
        self.stream.sync()


class _TorchEvent:
    """torch's CUDA event on the runner's stream, with the cuda.core event's `sync` and `close`."""

    def __init__(self, stream) -> None:
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def sync(self) -> None:
        self._event.synchronize()

    @property
    def is_done(self) -> bool:
        return self._event.query()

    def close(self) -> None:
        pass


def runner_for(placement: Placement) -> CpuRunner | CudaRunner:
    if placement.is_cuda:
        return CudaRunner(placement.device.index or 0)
    return CpuRunner()
