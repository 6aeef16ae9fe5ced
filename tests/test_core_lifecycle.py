"""The lane core's cancellation, shutdown, warm passes, adoption and device loss, on the fake backend.

Rules: exact assertions on events, plans and lanes; passes held inside the backend with events (never
sleeps); `MockClock(autojump_threshold=0)` where time passes; every core checks its integrity on exit and
its block pool must be balanced.
"""

import pytest
import trio

from engine_helpers import Gated, collect, greedy, lanes_of, prompt, running, solo
from lanes.core.commands import WarmCancelled
from lanes.core.fake import EOS, FakeBackend, fake_text
from lanes.core.lane_core import LaneCore
from lanes.core.stream import BackendFailed, Failed, Finished, Request, ShuttingDown, TokenEvent


def lanes_in(plan) -> set[int]:
    return {w.piece.lane for w in plan.work}


async def test_cancel_a_queued_stream_removes_it():
    backend = Gated(lanes=1)
    async with running(backend) as core:
        entered, release = backend.hold()
        busy = await core.submit(Request(prompt(3), greedy(3, ignore_eos=True)))
        await entered.wait()
        waiting = await core.submit(Request(prompt(3), greedy(3)))
        assert core.statistics().queued == 1
        core.cancel(waiting.id)
        core.cancel(waiting.id)  # idempotent
        outcome = await collect(waiting)
        assert outcome.last == Finished("cancelled", prompt_tokens=3) and outcome.tokens == []
        assert core.statistics().queued == 0
        release.set()
        assert (await collect(busy)).last.reason == "length"
    assert len(backend.plans) == 3  # the busy stream's prompt pass and two decode rounds, nothing for the other


async def test_cancel_while_prefilling_frees_the_lane_at_the_next_boundary():
    backend = Gated(lanes=2, blocks=64)
    async with running(backend, max_rows=8) as core:
        entered, release = backend.hold()
        stream = await core.submit(Request(prompt(40), greedy(4)))
        await entered.wait()  # its first chunk is inside the backend
        core.cancel(stream.id)
        release.set()
        outcome = await collect(stream)
        assert outcome.last == Finished("cancelled", prompt_tokens=40) and outcome.tokens == []
        assert core.lanes == [None, None]
        assert core.pool.free == core.pool.total
    assert [lanes_of(p) for p in backend.plans] == [[(0, 0, 8)]]


async def test_cancel_while_decoding_by_closing_the_stream():
    backend = Gated(lanes=2, blocks=64)
    async with running(backend) as core:
        other = await core.submit(Request(prompt(5, first=3), greedy(12, ignore_eos=True)))
        stream = await core.submit(Request(prompt(5), greedy(50, ignore_eos=True)))
        seen = [await stream.events.receive() for _ in range(2)]
        assert all(isinstance(e, TokenEvent) for e in seen)
        entered, release = backend.hold()
        await entered.wait()  # a pass with its decode row is inside the backend
        held = len(backend.plans)
        await stream.aclose()  # the consumer goes away mid-pass
        release.set()
        assert (await collect(other)).last.reason == "length"
        assert core.statistics().streams_cancelled == 1
    assert core.statistics().jobs_held == 0
    after = backend.plans[held + 1 :]  # every pass after the held one (plans[held]): lane 1 has no rows
    assert after and all(lanes_in(p) == {0} for p in after)


@pytest.mark.parametrize("run_ahead", [False, True])
async def test_a_cancel_during_the_final_pass_gives_one_terminal_event_and_frees_everything(run_ahead):
    backend = Gated(lanes=2, blocks=64)
    request = Request(prompt(5), greedy(3, ignore_eos=True))  # three passes: the prompt and two decode rows
    expected = (await solo(request)).tokens
    async with running(backend, run_ahead=run_ahead) as core:
        entered, release = backend.hold()
        stream = await core.submit(request)
        for _ in range(2):  # hold each pass in turn until the third, which draws the last token, is inside
            await entered.wait()
            entered, release_next = backend.hold()
            release.set()
            release = release_next
        await entered.wait()
        assert len(backend.plans) == 2  # a held pass is recorded once it is let through
        core.cancel(stream.id)
        await trio.testing.wait_all_tasks_blocked()  # the inbox has marked it cancelled, mid-pass
        release.set()
        outcome = await collect(stream)
        final = backend.plans[2]
        assert lanes_of(final) == [(0, 6, 1)] and final.work[0].sample.step == 2  # it drew the third token
        # Gated withholds `started`, so with run-ahead the second pass is applied only after the cancel
        kept = 1 if run_ahead else 2
        assert outcome.tokens == expected[:kept]
        assert [e for e in outcome.events if isinstance(e, (Finished, Failed))] == [outcome.last]
        assert outcome.last == Finished("cancelled", prompt_tokens=5, completion_tokens=kept)
        assert core.lanes == [None, None] and core.pool.free == core.pool.total and not backend.bound
        stats = core.statistics()
        assert (stats.streams_cancelled, stats.streams_finished, stats.lanes_busy) == (1, 0, 0)
        core.check_integrity()
        core.cancel(stream.id)  # after its end: nothing more happens
        after = await collect(await core.submit(Request(prompt(4, first=3), greedy(2, ignore_eos=True))))
        assert after.last.reason == "length"
    assert len(backend.plans) == 3 + 2  # the cancelled stream's three passes, then the next stream's two


async def test_a_consumer_that_only_closes_its_channel_is_noticed_at_the_boundary():
    backend = Gated(lanes=1, blocks=64)
    async with running(backend) as core:
        entered, release = backend.hold()
        stream = await core.submit(Request(prompt(5), greedy(100, ignore_eos=True)))
        await entered.wait()
        await stream.events.aclose()  # no cancel command: only the channel is closed
        release.set()
        follower = await core.submit(Request(prompt(4), greedy(2, ignore_eos=True)))
        assert (await collect(follower)).last.reason == "length"
    assert len(backend.plans) == 3  # the abandoned prompt pass, then the follower's prompt pass and one decode


async def test_cancel_after_the_end_and_of_unknown_ids_is_a_no_op():
    backend = FakeBackend(lanes=1)
    async with running(backend) as core:
        stream = await core.submit(Request(prompt(3), greedy(2, ignore_eos=True)))
        assert (await collect(stream)).last.reason == "length"
        core.cancel(stream.id)
        core.cancel(987654)
        again = await collect(await core.submit(Request(prompt(3), greedy(2, ignore_eos=True))))
        assert again.last.reason == "length"


async def test_shutdown_answers_every_waiter_at_every_stage(autojump_clock):
    backend = FakeBackend(lanes=3, blocks=64, pass_seconds=1.0)
    core = LaneCore(backend, fake_text, [EOS], max_rows=4, max_queue=8)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await nursery.start(core.run)
            short = await core.submit(Request(prompt(3), greedy(10, ignore_eos=True)))
            long = await core.submit(Request(prompt(10), greedy(500, ignore_eos=True)))
            prefilling = await core.submit(Request(prompt(200), greedy(5, ignore_eos=True)))  # 50 passes of prompt
            first_long = await long.events.receive()  # all three hold lanes now; the third is still prefilling
            queued = await core.submit(Request(prompt(3), greedy(3)))
            warm_result = []

            async def warm():
                with pytest.raises(WarmCancelled):
                    await core.warm(prompt(32))
                warm_result.append("cancelled")

            nursery.start_soon(warm)
            await trio.testing.wait_all_tasks_blocked()
            started = trio.current_time()
            await core.shutdown(grace=20)
            assert trio.current_time() - started == pytest.approx(20, abs=1.0)
    outcomes = {name: await collect(s) for name, s in [("short", short), ("long", long), ("queued", queued), ("prefilling", prefilling)]}
    assert isinstance(outcomes["prefilling"].last, Failed) and outcomes["prefilling"].tokens == []
    assert isinstance(first_long, TokenEvent)
    assert outcomes["short"].last.reason == "length" and len(outcomes["short"].tokens) == 10
    assert isinstance(outcomes["long"].last, Failed) and isinstance(outcomes["long"].last.error, ShuttingDown)
    assert 15 <= len(outcomes["long"].tokens) < 30  # one token a pass of 1 s until the grace ends
    assert isinstance(outcomes["queued"].last, Failed) and isinstance(outcomes["queued"].last.error, ShuttingDown)
    assert warm_result == ["cancelled"]
    with pytest.raises(ShuttingDown):
        await core.submit(Request(prompt(3), greedy(3)))
    core.check_integrity()
    assert core.pool.free == core.pool.total and not backend.bound


async def test_a_warm_pass_on_a_quiet_engine_keeps_its_full_blocks_in_the_prompt_cache():
    backend = FakeBackend(lanes=2, blocks=64)
    async with running(backend, max_rows=16, cache_bytes=8) as core:
        result = await core.warm(prompt(40))
        assert result.tokens == prompt(40)[:32] and result.kept
        cache = core.cache.statistics()
        assert (cache.entries, cache.pinned) == (2, 0)
        assert all(owner[0] == "cache" for owner in core.pool.owners()) and core.pool.free == core.pool.total - 2
        assert core.cache.lookup(prompt(40)).tokens == 32
    assert [lanes_of(p) for p in backend.plans] == [[(0, 0, 16)], [(0, 16, 16)], [(0, 32, 8)]]
    assert all(w.sample is None for p in backend.plans for w in p.work)


async def test_a_warm_pass_waits_for_quiet_and_yields_to_a_newer_request_and_never_runs_after():
    backend = Gated(lanes=2, blocks=64)
    warm_prompt = (49,) * 20
    async with running(backend, max_rows=8) as core:
        entered, release = backend.hold()
        busy = await core.submit(Request(prompt(3), greedy(4, ignore_eos=True)))
        await entered.wait()
        outcome = []

        async def warm():
            try:
                await core.warm(warm_prompt)
                outcome.append("done")
            except WarmCancelled:
                outcome.append("cancelled")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(warm)
            await trio.testing.wait_all_tasks_blocked()
            newer = await core.submit(Request(prompt(3, first=5), greedy(2, ignore_eos=True)))  # yields the warm pass
            release.set()
        assert outcome == ["cancelled"]
        for s in (busy, newer):
            assert (await collect(s)).last.reason == "length"
    assert not any(49 in w.piece.tokens for p in backend.plans for w in p.work)  # never launched


async def test_a_running_warm_pass_is_cancelled_by_a_newer_request():
    backend = Gated(lanes=2, blocks=64)
    async with running(backend, max_rows=8) as core:
        entered, release = backend.hold()
        outcome = []

        async def warm():
            try:
                await core.warm((49,) * 40)
            except WarmCancelled:
                outcome.append("cancelled")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(warm)
            await entered.wait()  # the warm pass's first chunk is inside the backend
            stream = await core.submit(Request(prompt(3), greedy(2, ignore_eos=True)))
            release.set()
        assert outcome == ["cancelled"]
        assert (await collect(stream)).last.reason == "length"
    warm_plans = [p for p in backend.plans if any(49 in w.piece.tokens for w in p.work)]
    assert [lanes_of(p) for p in warm_plans] == [[(0, 0, 8)]]


async def test_a_lost_device_fails_every_waiter_and_stops_the_core():
    backend = Gated(lanes=2, blocks=64, fail_at=3)
    core = LaneCore(backend, fake_text, [EOS])
    streams = []
    with trio.fail_after(30):
        with pytest.RaisesGroup(pytest.RaisesExc(BackendFailed, match="the model pass failed: RuntimeError: the fake device was lost")):
            async with trio.open_nursery() as nursery:
                await nursery.start(core.run)
                entered, release = backend.hold()
                for i in range(3):
                    streams.append(await core.submit(Request(prompt(3, first=i), greedy(20, ignore_eos=True))))
                    await entered.wait()
                release.set()  # pass 3 fails: two streams live, one queued
                await trio.sleep_forever()
    for stream in streams:
        last = (await collect(stream)).last
        assert isinstance(last, Failed) and isinstance(last.error, BackendFailed)
    core.check_integrity()
    assert core.pool.free == core.pool.total and not backend.bound
