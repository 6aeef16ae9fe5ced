"""Decisions in the lane core on the fake backend: a trunk prefilled once and branches batched beside live
streams, streams first, deadlines, cancellation, a full queue and shutdown, queued and in flight; a trunk
kept in the prompt cache and restored by the next decision over the same input.

Rules: exact plans and label reads (the fake's reads depend on the whole context it is given, so a wrong
trunk or block shows); passes held inside the backend with events, never sleeps; `MockClock` where time
passes; every ending also with the prompt cache on, with a restore's pin held while the decision ends, and
then no lane, block, pin or dead entry left; every core's integrity and balanced pool checked on exit.
"""

import pytest
import trio

from engine_helpers import Gated, collect, greedy, lanes_of, prompt, running, solo
from lanes.core.decider import DecisionCancelled, DecisionRequest, DecisionTimeout
from lanes.core.fake import FakeBackend
from lanes.core.stream import EngineError, QueueFull, Request, ShuttingDown

TRUNK = tuple(range(60, 60 + 40))  # two full blocks and 8 tokens in common
LABELS = ((5, 6), (7, 8, 9), (10, 11))


def branches(n: int = 3) -> DecisionRequest:
    prompts = tuple(TRUNK + (20 + i, 21 + i, 3) for i in range(n))
    return DecisionRequest(prompts, LABELS[:n])


CACHES = {"no-cache": 0, "cache": 64}  # in the fake's bytes, one a block: room for every chain here


def only_decision(core):
    """The one decision the decider holds, queued or under way."""
    (decision,) = list(core.decider.queue) + list(core.decider.running.values())
    return decision


def assert_nothing_left(core, cached_blocks: int) -> None:
    """No lane, block, pin or decision left; only the prompt cache's own chains hold blocks."""
    assert core.lanes == [None] * len(core.lanes) and not core.backend.bound
    assert not core.decider.queue and not core.decider.running
    assert core.pool.free == core.pool.total - cached_blocks
    assert all(owner[0] == "cache" for owner in core.pool.owners())
    if core.cache is not None:
        stats = core.cache.statistics()
        assert (stats.entries, stats.pinned, stats.dead) == (cached_blocks, 0, 0)
        core.cache.check_integrity()
    core.check_integrity()


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


@pytest.mark.parametrize("cache", sorted(CACHES))
async def test_deadlines_for_queued_and_running_decisions(cache, autojump_clock):
    backend = FakeBackend(lanes=1, blocks=64, pass_seconds=1.0)
    async with running(backend, max_rows=8, cache_bytes=CACHES[cache]) as core:
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
        assert_nothing_left(core, 2 if cache == "cache" else 0)  # only the last trunk finished, and was kept


@pytest.mark.parametrize("cache", sorted(CACHES))
async def test_a_cancelled_asker_cancels_its_decision_and_frees_its_lanes(cache):
    backend = Gated(lanes=3, blocks=64)
    async with running(backend, max_rows=64, cache_bytes=CACHES[cache]) as core:
        entered, release = backend.hold()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(core.decide, branches())
            await entered.wait()  # the trunk's pass is inside the backend
            nursery.cancel_scope.cancel()
        release.set()
        after = await collect(await core.submit(Request(prompt(3), greedy(2, ignore_eos=True))))
        assert after.last.reason == "length"
        assert core.decider.counts["failed"] == 1 and not core.decider.running
        assert_nothing_left(core, 0)  # a cancelled trunk is not kept
    assert all(len(p.work) <= 2 for p in backend.plans[1:])  # no branch ever ran


@pytest.mark.parametrize("cache", sorted(CACHES))
async def test_a_full_decision_queue_refuses_at_once_and_shutdown_fails_the_rest(cache):
    backend = Gated(lanes=1, blocks=64)
    outcomes = []
    async with running(backend, max_rows=64, max_decisions=1, cache_bytes=CACHES[cache]) as core:
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
    assert_nothing_left(core, 0)


@pytest.mark.parametrize("cache", sorted(CACHES))
async def test_cancelling_a_queued_decision_answers_it_cancelled_and_leaves_nothing(cache):
    backend = Gated(lanes=1, blocks=64)
    async with running(backend, max_rows=64, cache_bytes=CACHES[cache]) as core:
        entered, release = backend.hold()
        busy = await core.submit(Request(prompt(3), greedy(2, ignore_eos=True)))
        await entered.wait()  # the only lane is busy: the decision waits in the queue
        async with trio.open_nursery() as nursery:
            nursery.start_soon(core.decide, branches())
            await trio.testing.wait_all_tasks_blocked()
            decision = only_decision(core)
            assert decision in core.decider.queue
            nursery.cancel_scope.cancel()  # the asker goes away
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(decision.reply.error, DecisionCancelled)
        assert core.decider.counts == dict(asked=1, answered=0, failed=1)
        release.set()
        await collect(busy)
        assert_nothing_left(core, 0)
    assert not any(TRUNK[0] in w.piece.tokens for p in backend.plans for w in p.work)  # it never ran


ENDINGS = {"deadline": DecisionTimeout, "cancel": DecisionCancelled, "shutdown": ShuttingDown}


@pytest.mark.parametrize("stage", ["trunk", "branches"])
@pytest.mark.parametrize("ending", sorted(ENDINGS))
@pytest.mark.parametrize("cache", sorted(CACHES))
async def test_a_decision_ended_in_flight_frees_every_lane_block_and_pin(cache, ending, stage, mock_clock):
    backend = Gated(lanes=4, blocks=64)
    async with running(backend, max_rows=64, cache_bytes=CACHES[cache]) as core:
        first = await core.decide(branches())  # with the cache, this keeps the trunk for the next one
        request = DecisionRequest(branches().prompts, LABELS, deadline=trio.current_time() + 5)
        entered, release = backend.hold()
        seen = []

        async def ask():
            try:
                await core.decide(request)
            except EngineError as error:
                seen.append(type(error))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await entered.wait()  # the trunk's pass (a restore of its first block, with the cache) is inside
            if stage == "branches":
                entered, release_branches = backend.hold()
                release.set()
                await entered.wait()  # the three branches' pass is inside
                release = release_branches
            decision = only_decision(core)
            assert decision.id in core.decider.running
            pins = core.cache.statistics().pinned if core.cache else 0
            assert pins == (1 if cache == "cache" and stage == "trunk" else 0)  # the restore's pin is real
            if ending == "deadline":
                mock_clock.jump(5)
            elif ending == "shutdown":
                core.begin_shutdown(0)
            else:
                nursery.cancel_scope.cancel()  # the asker goes away
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(decision.reply.error, ENDINGS[ending])
        assert seen == ([] if ending == "cancel" else [ENDINGS[ending]])  # answered while its pass still runs
        release.set()
        if ending != "shutdown":
            after = await collect(await core.submit(Request(prompt(3), greedy(2, ignore_eos=True))))
            assert after.last.reason == "length"  # the held pass is settled: its lanes are free
            assert_nothing_left(core, 2 if cache == "cache" else 0)
            assert (await core.decide(branches())).reads == first.reads  # and the engine is whole
    if ending == "shutdown":
        assert_nothing_left(core, 0)  # a stopped core clears its cache: no pin was left to keep a chain dead
    answered = 1 if ending == "shutdown" else 2
    assert core.decider.counts == dict(asked=answered + 1, answered=answered, failed=1)


async def test_a_trunk_kept_in_the_cache_is_restored_by_a_later_decision_over_the_same_input():
    backend = FakeBackend(lanes=4, blocks=64)
    async with running(backend, max_rows=64, cache_bytes=64) as core:
        first = await core.decide(branches())
        kept = core.cache.statistics()
        second = await core.decide(branches())
        stats = core.cache.statistics()
        assert_nothing_left(core, 2)
    assert (kept.entries, kept.hits, kept.misses) == (2, 0, 1)  # the trunk's two full blocks
    assert (first.cached_tokens, second.cached_tokens) == (0, 16)  # a trunk still runs its last row
    assert (stats.hits, stats.hit_tokens) == (1, 16)
    assert second.reads == first.reads and second.input_tokens == first.input_tokens
    trunk_passes = [lanes_of(p) for p in backend.plans if len(p.work) == 1]
    assert trunk_passes == [[(0, 0, 32)], [(0, 16, 16)]]  # the second trunk computes only its second block
