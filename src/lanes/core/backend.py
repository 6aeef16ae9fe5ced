"""The one protocol between the lane core and whatever runs its passes (a family on a device, the fake).

Every wrapper around a backend (checks, tensor-parallel broadcast) derives from `BackendWrapper`, which
forwards every entry; the test that walks this protocol's members makes sure none is ever dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

from .media import PromptMedia
from .plan import PassResult, Plan
from .sampling import SamplingParams


@dataclass(frozen=True)
class BackendShape:
    """What the lane core must know of a backend to plan for it."""

    lanes: int
    blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    bytes_per_block: int = 1  # device bytes of one KV block (what the prompt cache charges)
    feeds: bool = False  # can run `fed` plans, queued behind the pass they read from (`Backend.step`)


@runtime_checkable
class Backend(Protocol):
    """Runs passes; keeps per-lane device state (penalty counts) between `bind` and `unbind`.

    Block ids come from the lane core's `BlockPool`; forking and releasing blocks is bookkeeping there and
    needs nothing from the device, because lanes share only full blocks and never write into them.
    """

    @property
    def shape(self) -> BackendShape: ...

    async def step(self, plan: Plan, started: Callable[[], None] | None = None,
                   following: Plan | None = None) -> PassResult:
        """Run one pass. Not cancellable midway: the device writes KV into the plan's blocks until it ends.
        `started`, if given, is called once, in the event loop, as soon as the pass is under way (from the
        stepping task or as a trio callback): the lane core settles the previous pass in it. `following`
        (a `fed` plan, where the shape `feeds`) is put on the device behind `plan` before `plan` is waited
        for; the next call must then be the step of it."""
        ...

    def bind(self, lane: int, prompt: Sequence[int], sampling: SamplingParams, media: Sequence[PromptMedia] = ()) -> None:
        """A stream takes `lane`: reset the lane's per-stream device state for this prompt and its images."""
        ...

    def unbind(self, lane: int) -> None:
        """The lane is free again."""
        ...

    async def aclose(self) -> None: ...


class BackendWrapper:
    """Forwards every entry of `Backend` to `inner`; subclasses override the entries they add to."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property
    def shape(self) -> BackendShape:
        return self.inner.shape

    async def step(self, plan: Plan, started: Callable[[], None] | None = None,
                   following: Plan | None = None) -> PassResult:
        return await self.inner.step(plan, started, following)

    def bind(self, lane: int, prompt: Sequence[int], sampling: SamplingParams, media: Sequence[PromptMedia] = ()) -> None:
        self.inner.bind(lane, prompt, sampling, media)

    def unbind(self, lane: int) -> None:
        self.inner.unbind(lane)

    async def aclose(self) -> None:
        await self.inner.aclose()
