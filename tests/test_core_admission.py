"""The lane core's admission and passes on the fake backend: batched prompt passes of up to 16, chunked
prompts beside decoding lanes, the bounded FIFO queue and its deadlines, concurrent equals solo.

Rules: exact assertions on plans, lanes and tokens; `MockClock(autojump_threshold=0)` where time passes;
passes held inside the backend with events, never sleeps; `check_integrity()` after every test (the
`running` helper checks it and the pool's balance on exit).
"""

import pytest
import trio

from engine_helpers import Gated, collect, greedy, lanes_of, prompt, running, seeded, solo
from lanes.core.fake import FakeBackend
from lanes.core.sampling import InvalidParameter, SamplingParams
from lanes.core.stream import EmptyPrompt, Failed, PromptTooLong, QueueFull, QueueTimeout, Request


async def test_up_to_16_prompts_go_in_one_pass_in_arrival_order():
    backend = Gated(lanes=20, blocks=200)
    async with running(backend, max_rows=10_000) as core:
        entered, release = backend.hold()
        blocker = await core.submit(Request(prompt(3), greedy(6)))
        await entered.wait()  # the blocker's prompt pass is inside the backend
        streams = [await core.submit(Request(prompt(5, first=i), greedy(2))) for i in range(19)]
        release.set()
        outcomes = [await collect(s) for s in [blocker] + streams]
    first, second, third = backend.plans[:3]
    assert lanes_of(first) == [(0, 0, 3)]
    assert second.prefills == 16
    assert lanes_of(second) == [(lane, 0, 5) for lane in range(1, 17)] + [(0, 3, 1)]
    assert third.prefills == 3
    assert lanes_of(third)[:3] == [(17, 0, 5), (18, 0, 5), (19, 0, 5)]
    assert sorted(lanes_of(third)[3:]) == [(lane, 5 if lane else 4, 1) for lane in range(17)]
    assert [o.last.reason for o in outcomes] == ["length"] * 20


async def test_a_long_prompt_goes_in_chunks_while_three_streams_decode_in_every_pass():
    backend = Gated(lanes=4, blocks=100)
    shorts = [Request(prompt(4, first=i), greedy(20, ignore_eos=True)) for i in range(3)]
    long_request = Request(prompt(100), greedy(2, ignore_eos=True))
    async with running(backend, max_rows=32) as core:
        entered, release = backend.hold()
        first = await core.submit(shorts[0])
        await entered.wait()  # pass 1: the first short prompt
        others = [await core.submit(r) for r in shorts[1:]]
        entered, release_second = backend.hold()
        release.set()
        await entered.wait()  # pass 2: the other two prompts, the first one's decode row
        long = await core.submit(long_request)
        release_second.set()
        outcomes = [await collect(s) for s in [first, *others, long]]
    assert lanes_of(backend.plans[1]) == [(1, 0, 4), (2, 0, 4), (0, 4, 1)]
    chunk_plans = backend.plans[2:6]
    assert [lanes_of(p)[0] for p in chunk_plans] == [(3, 0, 32), (3, 32, 32), (3, 64, 32), (3, 96, 4)]
    for p in chunk_plans:
        assert p.prefills == 1
        assert sorted(lanes_of(p)[1:]) == [(0, p.step + 3, 1), (1, p.step + 2, 1), (2, p.step + 2, 1)]
    assert [o.last.reason for o in outcomes] == ["length"] * 4
    for request, outcome in zip([*shorts, long_request], outcomes):
        assert outcome.tokens == (await solo(request, max_rows=32)).tokens


async def test_a_full_queue_refuses_at_once_and_frees_nothing():
    backend = Gated(lanes=2, blocks=64)
    async with running(backend, max_queue=2) as core:
        entered, release = backend.hold()
        live = [await core.submit(Request(prompt(3), greedy(6, ignore_eos=True)))]
        await entered.wait()  # pass 1 holds the first stream; the second waits in the queue
        live.append(await core.submit(Request(prompt(3, first=1), greedy(6, ignore_eos=True))))
        entered, release_second = backend.hold()
        release.set()
        await entered.wait()  # pass 2: both lanes busy, the queue empty
        queued = [await core.submit(Request(prompt(3, first=i), greedy(4, ignore_eos=True))) for i in range(2, 4)]
        assert (core.statistics().queued, core.statistics().lanes_busy) == (2, 2)
        with pytest.raises(QueueFull, match="the admission queue is full \\(2 waiting\\)"):
            await core.submit(Request(prompt(3), greedy(4)))
        release_second.set()
        outcomes = [await collect(s) for s in live + queued]
    assert [o.last.reason for o in outcomes] == ["length"] * 4
    assert [len(o.tokens) for o in outcomes] == [6, 6, 4, 4]


async def test_a_queued_request_past_its_deadline_gets_queue_timeout(autojump_clock):
    backend = FakeBackend(lanes=1, blocks=64, pass_seconds=1.0)
    async with running(backend) as core:
        busy = await core.submit(Request(prompt(3), greedy(10)))
        waiting = await core.submit(Request(prompt(3), greedy(4), deadline=trio.current_time() + 2.5))
        patient = await core.submit(Request(prompt(3), greedy(4), deadline=trio.current_time() + 100))
        late = await collect(waiting)
        assert isinstance(late.last, Failed) and isinstance(late.last.error, QueueTimeout)
        assert trio.current_time() == pytest.approx(2.5)
        assert (await collect(busy)).last.reason == "length"
        assert (await collect(patient)).last.reason == "length"
        assert trio.current_time() == pytest.approx(10 + 4)


async def test_requests_that_cannot_fit_are_refused_by_name():
    backend = FakeBackend(lanes=2, blocks=4, max_model_len=40)
    async with running(backend) as core:
        with pytest.raises(PromptTooLong, match="the request needs 41 tokens of context, the limit is 40"):
            await core.submit(Request(prompt(40), greedy(1)))
        with pytest.raises(PromptTooLong, match="the request needs 45 tokens of context, the limit is 40"):
            await core.submit(Request(prompt(5), greedy(40)))
        with pytest.raises(InvalidParameter, match="temperature must be between 0 and 2"):
            await core.submit(Request(prompt(5), SamplingParams(temperature=3)))
        with pytest.raises(EmptyPrompt, match="the prompt is empty: a prompt needs at least one token"):
            await core.submit(Request((), greedy(1)))
        with pytest.raises(InvalidParameter, match="logit_bias token ids must be between 0 and 49"):
            await core.submit(Request(prompt(5), greedy(1, logit_bias=((50, 1.0),))))
        with pytest.raises(InvalidParameter, match="stop_token_ids token ids must be between 0 and 49"):
            await core.submit(Request(prompt(5), greedy(1, stop_token_ids=(3, -1))))
        ok = await collect(await core.submit(Request(prompt(5), SamplingParams(temperature=0, ignore_eos=True))))
    assert ok.last.reason == "length" and len(ok.tokens) == 35  # max_tokens absent: up to the model's length


async def test_concurrent_equals_solo_on_the_fake():
    requests = [Request(prompt(3 + 5 * i, first=i), greedy(12) if i % 2 else seeded(100 + i, 12)) for i in range(12)]
    backend = FakeBackend(lanes=5, blocks=200)
    async with running(backend, max_rows=24) as core:
        streams = [await core.submit(r) for r in requests]
        together = [await collect(s) for s in streams]
    for request, outcome in zip(requests, together):
        alone = await solo(request, max_rows=24)
        assert outcome.tokens == alone.tokens
        assert outcome.text == alone.text


async def test_stop_strings_stop_tokens_and_eos():
    backend = FakeBackend(lanes=4, blocks=64)
    async with running(backend) as core:
        reference = await collect(await core.submit(Request(prompt(6), greedy(10))))
        words = reference.text.split()
        # A stop string spanning two tokens' text: nothing of it is emitted.
        cut = await collect(await core.submit(Request(prompt(6), greedy(10, stop=(f"{words[2][1:]} {words[3][:2]}",)))))
        assert cut.text == " ".join(words[:2]) + " t"
        assert cut.last.reason == "stop" and cut.tokens == reference.tokens[:4]
        stopped = await collect(await core.submit(Request(prompt(6), greedy(10, stop_token_ids=(reference.tokens[1],)))))
        assert stopped.tokens == reference.tokens[:2] and stopped.last.reason == "stop"
        assert stopped.text == words[0] + " "


async def test_statistics_count_passes_rows_and_tokens():
    backend = FakeBackend(lanes=2, blocks=64)
    async with running(backend, max_rows=8) as core:
        await collect(await core.submit(Request(prompt(20), greedy(3))))
        stats = core.statistics()
    assert (stats.passes, stats.prefill_rows, stats.decode_rows, stats.tokens_out) == (5, 20, 2, 3)
    assert (stats.streams_admitted, stats.streams_finished, stats.lanes, stats.lanes_free, stats.max_rows) == (1, 1, 2, 2, 8)
