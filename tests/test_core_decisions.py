"""Decisions in the lane core on the fake backend: a trunk prefilled once and branches batched beside live
streams, streams first, deadlines, cancellation, a full queue and shutdown.

Rules: exact plans and label reads (the fake's reads depend on the whole context it is given, so a wrong
trunk or block shows); passes held inside the backend with events, never sleeps; `MockClock` where time
passes; every core's integrity and balanced pool checked on exit (the `running` helper).
"""

import pytest
import trio

from engine_helpers import Gated, collect, greedy, lanes_of, prompt, running, solo
from lanes.core.decider import DecisionRequest, DecisionTimeout
from lanes.core.fake import FakeBackend
from lanes.core.stream import QueueFull, Request, ShuttingDown

TRUNK = tuple(range(60, 60 + 40))  # two full blocks and 8 tokens in common
LABELS = ((5, 6), (7, 8, 9), (10, 11))


def branches(n: int = 3) -> DecisionRequest:
    prompts = tuple(TRUNK + (20 + i, 21 + i, 3) for i in range(n))
    return DecisionRequest(prompts, LABELS[:n])


async def test_trunk_once_then_branches_batched_equal_independent_reads():
    backend = FakeBackend(lanes=4, blocks=64)
    async with running(backend, max_rows=64) as core:
        result = await core.decide(branches())
    trunk_plans = [lanes_of(p) for p in backend.plans]
    assert trunk_plans[0] == [(0, 0, 32)]  # the trunk's two full blocks, once
    assert sorted(trunk_plans[1]) == [(0, 32, 11), (1, 32, 11), (2, 32, 11)]  # three branches in one pass
    assert (result.input_tokens, result.cached_tokens) == (32 + 3 * 11, 0)
    for index, read in enumerate(result.reads):
        alone_backend = FakeBackend(lanes=4, blocks=64)
        async with running(alone_backend, max_rows=64) as core:
            single = DecisionRequest((branches().prompts[index],), (LABELS[index],))
            alone = (await core.decide(single)).reads[0]
        assert read == alone
        assert len(read.logprobs) == len(LABELS[index])


async def test_a_request_waiting_for_a_lane_goes_before_a_queued_decision():
    backend = Gated(lanes=1, blocks=64)
    async with running(backend, max_rows=64) as core:
        entered, release = backend.hold()
        busy = await core.submit(Request(prompt(3), greedy(2, ignore_eos=True)))
        await entered.wait()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(core.decide, DecisionRequest((prompt(5, first=9),), ((1, 2),)))
            await trio.testing.wait_all_tasks_blocked()
            waiting = await core.submit(Request(prompt(4, first=3), greedy(2, ignore_eos=True)))
            release.set()
            await collect(busy)
            await collect(waiting)
    firsts = [lanes_of(p)[0] for p in backend.plans if p.prefills]
    assert [rows for _, _, rows in firsts] == [3, 4, 5]  # the busy stream, the waiting one, then the decision


async def test_live_streams_produce_their_solo_tokens_while_decisions_run_beside_them():
    requests = [Request(prompt(4 + 3 * i, first=i), greedy(12, ignore_eos=True)) for i in range(4)]
    backend = FakeBackend(lanes=6, blocks=128)
    async with running(backend, max_rows=16) as core:
        streams = [await core.submit(r) for r in requests]
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(core.decide, branches())
        together = [await collect(s) for s in streams]
    assert any(p.prefills and p.decode_rows for p in backend.plans)  # decisions really ran beside decoding
    for request, outcome in zip(requests, together):
        assert outcome.tokens == (await solo(request, max_rows=16)).tokens


async def test_deadlines_for_queued_and_running_decisions(autojump_clock):
    backend = FakeBackend(lanes=1, blocks=64, pass_seconds=1.0)
    async with running(backend, max_rows=8) as core:
        busy = await core.submit(Request(prompt(3), greedy(10, ignore_eos=True)))
        now = trio.current_time()
        with pytest.raises(DecisionTimeout, match="the decision did not finish before its deadline"):
            await core.decide(DecisionRequest(branches().prompts, LABELS, deadline=now + 2.5))  # queued behind busy
        assert trio.current_time() == pytest.approx(now + 2.5)
        await collect(busy)
        now = trio.current_time()
        with pytest.raises(DecisionTimeout):  # admitted, but its 43-token prompts need more than 3 passes
            await core.decide(DecisionRequest(branches().prompts, LABELS, deadline=now + 3.5))
        assert core.statistics().lanes_busy <= 1
        result = await core.decide(branches())  # the engine is whole afterwards
        assert len(result.reads) == 3


async def test_a_cancelled_asker_cancels_its_decision_and_frees_its_lanes():
    backend = Gated(lanes=3, blocks=64)
    async with running(backend, max_rows=64) as core:
        entered, release = backend.hold()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(core.decide, branches())
            await entered.wait()  # the trunk's pass is inside the backend
            nursery.cancel_scope.cancel()
        release.set()
        after = await collect(await core.submit(Request(prompt(3), greedy(2, ignore_eos=True))))
        assert after.last.reason == "length"
        assert core.decider.counts["failed"] == 1 and not core.decider.running
    assert all(len(p.work) <= 2 for p in backend.plans[1:])  # no branch ever ran


async def test_a_full_decision_queue_refuses_at_once_and_shutdown_fails_the_rest():
    backend = Gated(lanes=1, blocks=64)
    outcomes = []
    async with running(backend, max_rows=64, max_decisions=1) as core:
        entered, release = backend.hold()
        busy = await core.submit(Request(prompt(3), greedy(50, ignore_eos=True)))
        await entered.wait()

        async def ask():
            try:
                await core.decide(branches())
                outcomes.append("answered")
            except ShuttingDown:
                outcomes.append("shutting down")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(QueueFull):
                await core.decide(branches())
            core.begin_shutdown(0)
            release.set()
        await collect(busy)
    assert outcomes == ["shutting down"]
