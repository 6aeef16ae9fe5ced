"""Run one scenario against the real lane core (fake backend, virtual time) and check every invariant.

Invariants: every waiter answered exactly once (a result or a typed error); every lane free; the block
pool balanced; no pin and no decision's blocks left; no task left running (the nursery closed); each
component's `check_integrity()`; and, against solo runs on a fresh engine, every stream that finished
received exactly its solo tokens, every other stream (ended by a deadline, the shutdown, the lost device
or its client) a prefix of them, and every answered decision its solo reads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import trio
import trio.testing

from lanes.core.backend import BackendWrapper
from lanes.core.commands import WarmCancelled
from lanes.core.decider import DecisionCancelled, DecisionRequest, DecisionTimeout
from lanes.core.fake import EOS, FakeBackend, FakeDrafter, fake_text
from lanes.core.lane_core import LaneCore
from lanes.core.sampling import InvalidParameter, SamplingParams
from lanes.core.stream import BackendFailed, EngineError, Failed, Finished, Request, TokenEvent

from .deterministic import deterministic_schedule
from .scenarios import Scenario, StreamClient, draw, encode

EXPECTED_ERRORS = (EngineError, InvalidParameter)
HANG = 24 * 3600.0  # virtual seconds: far past any scenario's horizon


class FuzzFailure(AssertionError):
    """An invariant broke; `reproducer` is the one line that runs the same scenario again (its seed when
    `draw` gives it, else the whole scenario encoded)."""

    def __init__(self, scn: Scenario, message: str, backend_kind: str = "fake") -> None:
        option = "" if backend_kind == "fake" else f" --backend {backend_kind}"
        which = f"--seed {scn.seed} --one" if scn.drawn else f"--scenario {encode(scn)}"
        self.reproducer = f"python -m fuzz {which}{option}"
        super().__init__(f"{message}\n  reproduce: {self.reproducer}")
        self.scenario, self.seed, self.message = scn, scn.seed, message


def describe(error: BaseException) -> str:
    """A crash in words: the first error raised, then what it led to (through groups and contexts)."""
    chain: list[BaseException] = []
    while error is not None and len(chain) < 4:
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        chain.append(error)
        error = error.__cause__ or error.__context__
    return "; then ".join(f"{type(e).__name__}: {e}" for e in reversed(chain))


def fuzz_core(*args, restore_failures: float = 0.0, seed: int = 0, **kwargs) -> LaneCore:
    """The real lane core with one fault switch: restores fail at the scenario's rate (seeded)."""
    rng = random.Random(seed)
    fault = (lambda: rng.random() < restore_failures) if restore_failures else None
    return LaneCore(*args, restore_fault=fault, **kwargs)


@dataclass
class Record:
    """What one client saw."""

    kind: str
    events: list = field(default_factory=list)
    error: BaseException | None = None
    left: bool = False  # the client went away (or cancelled) on purpose
    result: object = None


def sampling_of(client: StreamClient) -> SamplingParams:
    greedy = client.seed is None
    return SamplingParams(temperature=0 if greedy else 0.9, top_p=1.0 if greedy else 0.9, seed=client.seed,
                          max_tokens=client.max_tokens, stop=client.stop)


class InlineRunner:
    """Runs a pass on the event loop itself: instant in virtual time, so autojump never races a thread."""

    async def run(self, fn, started=None):
        if started is not None:
            started()
        await trio.lowlevel.checkpoint()
        return fn()

    async def run_launched(self, launch, started=None):
        return await self.run(lambda: launch().result(), started)

    def close(self) -> None:
        pass


class LosesDevice(BackendWrapper):
    """A backend whose `fail_at`-th pass raises: the death of a follower rank, simulated."""

    def __init__(self, inner, fail_at: int | None = None) -> None:
        super().__init__(inner)
        self.fail_at, self.passes = fail_at, 0

    async def step(self, plan, started=None, following=None):
        self.passes += 1
        if self.passes == self.fail_at:
            raise RuntimeError("a follower rank died")
        return await self.inner.step(plan, started, following)


_models: dict[int, object] = {}


def torch_backend(scn: Scenario):
    """The tiny torch model (built once a pool size) as a backend, passes run inline."""
    from lanes.backend.torch_backend import TorchBackend

    if scn.blocks not in _models:
        import tempfile
        from pathlib import Path

        from lanes.gpu.device import choose
        from lanes.loader import load_model
        from tests import tiny

        folder = Path(tempfile.mkdtemp(prefix="fuzz-tiny-"))
        tiny.build("qwen2", folder, max_position_embeddings=512)
        _models[scn.blocks] = load_model(folder, choose("cpu", "fp32"), kv_blocks=scn.blocks, quiet=True)
    return TorchBackend(_models[scn.blocks], InlineRunner(), lanes=scn.lanes, max_model_len=512)


def build(scn: Scenario, solo: bool = False, backend_kind: str = "fake") -> tuple[LaneCore, object]:
    fail_at = None if solo else scn.device_lost_at
    if backend_kind == "torch":
        backend = LosesDevice(torch_backend(scn), fail_at)
    else:
        # Half the scenarios run on a fake that feeds (fed passes queued behind the running one).
        backend = FakeBackend(lanes=scn.lanes, blocks=scn.blocks, pass_seconds=scn.pass_seconds, fail_at=fail_at,
                              feeds=scn.seed % 2 == 0)
    # Solo runs draft nothing: every stream of a drafting scenario must get exactly its undrafted tokens.
    drafts = None if solo or scn.draft_wrong is None else FakeDrafter(backend.shape.vocab_size, scn.draft_wrong,
                                                                      seed=scn.seed)
    core = fuzz_core(backend, fake_text, [EOS], max_rows=scn.max_rows, max_queue=1024 if solo else scn.max_queue,
                     max_decisions=1024 if solo else scn.max_decisions, cache_bytes=scn.cache_bytes,
                     restore_failures=0.0 if solo else scn.restore_failure_rate, seed=scn.seed, drafts=drafts,
                     draft_control=False)  # virtual time: the lengths may not depend on the machine's clock
    return core, backend


async def stream_client(core: LaneCore, client: StreamClient, record: Record) -> None:
    await trio.sleep_until(client.at)
    deadline = float("inf") if client.deadline is None else trio.current_time() + client.deadline
    with trio.CancelScope(deadline=client.cancel_at if client.cancel_at is not None else float("inf")) as scope:
        try:
            stream = await core.submit(Request(client.prompt, sampling_of(client), deadline))
        except EXPECTED_ERRORS as error:
            record.error = error
            return
        try:
            async for event in stream.events:
                record.events.append(event)
                if client.leave_after is not None and len(record.events) >= client.leave_after:
                    record.left = True
                    break
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
    if scope.cancelled_caught:
        record.left = True


async def decision_client(core: LaneCore, client, record: Record) -> None:
    await trio.sleep_until(client.at)
    deadline = float("inf") if client.deadline is None else trio.current_time() + client.deadline
    with trio.CancelScope(deadline=client.cancel_at if client.cancel_at is not None else float("inf")) as scope:
        try:
            record.result = await core.decide(DecisionRequest(client.prompts, client.labels, deadline))
        except EXPECTED_ERRORS as error:
            record.error = error
    if scope.cancelled_caught:
        record.left = True


async def warm_client(core: LaneCore, client, record: Record) -> None:
    await trio.sleep_until(client.at)
    try:
        record.result = await core.warm(client.prompt)
    except EXPECTED_ERRORS as error:
        record.error = error


async def run_scenario(scn: Scenario, backend_kind: str = "fake") -> tuple[dict, LaneCore]:
    core, backend = build(scn, backend_kind=backend_kind)
    records: dict[str, Record] = {}
    lost: list[BackendFailed] = []

    async def run_core(task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await core.run(task_status=task_status)
        except BackendFailed as error:  # the lost device of the scenario: the clients carry on and are refused
            lost.append(error)

    with trio.move_on_after(HANG) as watchdog:  # virtual time: a deadlock jumps straight here
        await run_clients(scn, core, records, run_core)
    if watchdog.cancelled_caught:
        raise FuzzFailure(scn, f"hung: still running after {HANG:.0f} s of virtual time", backend_kind)
    if lost and scn.device_lost_at is None:
        raise FuzzFailure(scn, f"the backend failed: {lost[0]}", backend_kind)
    return records, core


async def run_clients(scn: Scenario, core: LaneCore, records: dict, run_core) -> None:
    async with trio.open_nursery() as outer:
        await outer.start(run_core)
        async with trio.open_nursery() as clients:
            for i, c in enumerate(scn.streams):
                records[f"stream{i}"] = Record("stream")
                clients.start_soon(stream_client, core, c, records[f"stream{i}"])
            for i, c in enumerate(scn.decisions):
                records[f"decision{i}"] = Record("decision")
                clients.start_soon(decision_client, core, c, records[f"decision{i}"])
            for i, c in enumerate(scn.warms):
                records[f"warm{i}"] = Record("warm")
                clients.start_soon(warm_client, core, c, records[f"warm{i}"])
            if scn.shutdown_at is not None:
                clients.start_soon(shutdown_later, core, scn.shutdown_at, scn.grace)
        await core.shutdown(0)


async def shutdown_later(core: LaneCore, at: float, grace: float) -> None:
    await trio.sleep_until(at)
    core.begin_shutdown(grace)


def check(scn: Scenario, records: dict, core: LaneCore, backend_kind: str = "fake") -> None:
    """Every invariant of the module docstring but the solo runs', or FuzzFailure."""

    def fail(message: str) -> None:
        raise FuzzFailure(scn, message, backend_kind)

    try:
        core.check_integrity()
    except AssertionError as error:
        fail(f"integrity: {error}")
    if any(job is not None for job in core.lanes):
        fail("a lane is still held")
    if core.pool.free != core.pool.total:
        fail(f"the block pool is not balanced: {core.pool.statistics()}")
    if core.decider.queue or core.decider.running:
        fail("a decision is still queued or running")
    for name, record in records.items():
        if record.kind == "stream" and record.error is None and not record.left:
            ends = [e for e in record.events if isinstance(e, (Finished, Failed))]
            if len(ends) != 1 or record.events[-1] is not ends[0]:
                fail(f"{name} did not get exactly one final event: {record.events[-3:]}")
        if record.kind == "decision" and not record.left and (record.result is None) == (record.error is None):
            fail(f"{name} got no answer or two")
        if record.error is not None and not isinstance(record.error, EXPECTED_ERRORS):
            fail(f"{name} got an untyped error {record.error!r}")
        if record.kind == "warm" and record.result is None and not isinstance(record.error, (WarmCancelled, EngineError)):
            fail(f"{name} got no answer")


def solo_equal(scn: Scenario, records: dict, backend_kind: str = "fake") -> None:
    """A stream that finished got exactly its solo tokens; any other stream that got tokens (ended by a
    deadline, the shutdown, the lost device or its client) got a prefix of them: nothing wrong, nothing
    reordered. An answered decision got its solo reads."""
    solo: dict[tuple, list[int]] = {}
    for i, client in enumerate(scn.streams):
        record = records[f"stream{i}"]
        tokens = [e.token for e in record.events if isinstance(e, TokenEvent)]
        last = record.events[-1] if record.events else None
        finished = isinstance(last, Finished) and last.reason != "cancelled"
        if not tokens and not finished:
            continue
        key = (client.prompt, sampling_of(client))
        if key not in solo:
            solo[key] = trio.run(solo_stream, scn, client, backend_kind, clock=trio.testing.MockClock(autojump_threshold=0))
        alone = solo[key]
        if finished and tokens != alone:
            raise FuzzFailure(scn, f"stream{i} got {tokens}, alone it gets {alone}", backend_kind)
        if not finished and tokens != alone[: len(tokens)]:
            raise FuzzFailure(scn, f"stream{i} ended by {ending(record)} after {tokens}, not a prefix of its solo "
                                   f"{alone}", backend_kind)
    for i, client in enumerate(scn.decisions):
        record = records[f"decision{i}"]
        if record.result is None:
            continue
        alone = trio.run(solo_decision, scn, client, backend_kind, clock=trio.testing.MockClock(autojump_threshold=0))
        if record.result.reads != alone.reads:
            raise FuzzFailure(scn, f"decision{i}'s reads differ from its solo run", backend_kind)


def ending(record: Record) -> str:
    """How a stream that did not finish ended, in words."""
    last = record.events[-1] if record.events else None
    if isinstance(last, Failed):
        return type(last.error).__name__
    return "its client leaving" if record.left else f"{last!r}"


async def solo_stream(scn: Scenario, client: StreamClient, backend_kind: str) -> list[int]:
    core, _ = build(scn, solo=True, backend_kind=backend_kind)
    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        stream = await core.submit(Request(client.prompt, sampling_of(client)))
        tokens = [e.token async for e in stream.events if isinstance(e, TokenEvent)]
        await core.shutdown(0)
    return tokens


async def solo_decision(scn: Scenario, client, backend_kind: str):
    core, _ = build(scn, solo=True, backend_kind=backend_kind)
    async with trio.open_nursery() as nursery:
        await nursery.start(core.run)
        result = await core.decide(DecisionRequest(client.prompts, client.labels))
        await core.shutdown(0)
    return result


def run_seed(seed: int, backend_kind: str = "fake") -> Scenario:
    """Draw the scenario of `seed` and run it (`run_one`)."""
    return run_one(draw(seed), backend_kind)


def run_one(scn: Scenario, backend_kind: str = "fake", solo: bool = True) -> Scenario:
    """Run `scn` under its deterministic schedule and virtual time and check it (FuzzFailure if broken).
    `backend_kind`: the fake backend, or "torch" for the tiny torch model; `solo=False` leaves out the
    comparison with solo runs (every other invariant is still checked)."""
    with deterministic_schedule(scn.seed):
        try:
            records, core = trio.run(run_scenario, scn, backend_kind, clock=trio.testing.MockClock(autojump_threshold=0))
        except FuzzFailure:
            raise
        except Exception as error:  # a crash is a finding too, with its reproducer
            raise FuzzFailure(scn, f"crashed: {describe(error)}", backend_kind) from error
        check(scn, records, core, backend_kind)
    if solo:
        solo_equal(scn, records, backend_kind)
    return scn
