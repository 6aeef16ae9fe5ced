"""Fed passes: on a device that feeds, the decode pass after the running one is queued behind it before it
ends, its tokens read on the device from the running pass's draws (docs/DECISIONS.md, "Fed passes").

Rules: the fake backend with `feeds` (a fed pass runs when handed over and reads the draws of the pass
before it, by lane; it raises if a fed pass is not stepped right after the one it reads); exact plans;
outputs equal each stream's solo run on a fake that does not feed; books checked and every block free at
the end (engine_helpers.running); under `trio.fail_after`.
"""

import trio

from engine_helpers import collect, greedy, prompt, running, seeded, solo
from lanes.core.fake import FakeBackend
from lanes.core.stream import Request


def kinds(backend) -> list[str]:
    """Each pass as "prefill", "host" (a decode pass whose tokens came from the host) or "fed"."""
    return ["prefill" if p.prefills else "fed" if p.fed else "host" for p in backend.plans]


async def test_a_stream_runs_on_fed_passes_once_it_decodes():
    request = Request(prompt(5), greedy(12, ignore_eos=True))
    alone = await solo(request)
    backend = FakeBackend(lanes=2, blocks=64, feeds=True)
    async with running(backend) as core:
        outcome = await collect(await core.submit(request))
    assert outcome.tokens == alone.tokens and outcome.text == alone.text
    # The prompt pass draws token 1; the first decode pass is planned from it; every later one is queued
    # behind the pass before it, and none runs past the stream's 12 tokens.
    assert kinds(backend) == ["prefill", "host"] + ["fed"] * 10
    assert [p.work[0].piece.start for p in backend.plans[1:]] == list(range(5, 16))
    assert [p.work[0].sample.step for p in backend.plans[1:]] == list(range(1, 12))


async def test_concurrent_streams_on_fed_passes_equal_their_solo_runs():
    """Stop tokens, stop strings, lengths and cancels end streams while passes fed from them are queued."""
    requests = [Request(prompt(3 + i, first=i), greedy(4 + 3 * i)) for i in range(6)]
    requests += [Request(prompt(7, first=9), greedy(20, ignore_eos=True)), Request(prompt(6, first=3), seeded(5, 9))]
    alone = [await solo(r) for r in requests]
    stop = alone[6].text.split()[5]  # a stop string that ends stream 6 after its sixth token
    requests.append(Request(prompt(7, first=9), greedy(20, ignore_eos=True, stop=(stop,))))
    alone.append(await solo(requests[-1]))
    backend = FakeBackend(lanes=len(requests), blocks=200, feeds=True)
    async with running(backend) as core:
        outcomes = [None] * len(requests)
        async with trio.open_nursery() as nursery:
            for i, request in enumerate(requests):
                async def one(i=i, request=request):
                    outcomes[i] = await collect(await core.submit(request))
                nursery.start_soon(one)
    for outcome, expected in zip(outcomes, alone):
        assert outcome.tokens == expected.tokens and outcome.text == expected.text
        assert outcome.last == expected.last
    assert "fed" in kinds(backend)
    # The seeded stream is never in a fed pass (its draw needs the host's sampler): none runs beside it.
    assert all(w.sample.params.greedy for p in backend.plans if p.fed for w in p.work)


async def test_fed_passes_resume_once_a_stream_that_needs_the_host_sampler_has_ended():
    """A seeded stream keeps passes from being fed while it runs; once it ends, the passes planned ahead from
    the others' rows are plain again and fed, without waiting for a fresh plan."""
    requests = [Request(prompt(5, first=1), greedy(30, ignore_eos=True)), Request(prompt(4, first=2), seeded(5, 4)),
                Request(prompt(6, first=3), greedy(30, ignore_eos=True))]
    alone = [await solo(r) for r in requests]
    backend = FakeBackend(lanes=3, blocks=64, feeds=True)
    async with running(backend) as core:
        streams = [await core.submit(r) for r in requests]
        outcomes = [await collect(s) for s in streams]
    assert [o.tokens for o in outcomes] == [a.tokens for a in alone]
    seeded_lane = next(w.piece.lane for p in backend.plans for w in p.work if not w.sample.params.greedy)
    last = max(i for i, p in enumerate(backend.plans) if any(w.piece.lane == seeded_lane for w in p.work))
    after = kinds(backend)[last + 1:]
    assert len(after) > 20 and after[1:] == ["fed"] * (len(after) - 1), after


async def test_a_stream_a_stop_token_ends_gets_at_most_one_void_fed_row():
    request = Request(prompt(4, first=5), greedy(40))
    alone = await solo(request)
    assert alone.last.reason == "stop" and 2 < len(alone.tokens) < 40  # the fake drew its end-of-sequence token
    backend = FakeBackend(lanes=2, blocks=64, feeds=True)
    async with running(backend) as core:
        outcome = await collect(await core.submit(request))
    assert outcome.tokens == alone.tokens and outcome.last == alone.last
    rows = [len(p.work) for p in backend.plans if not p.prefills]
    # One decode row a token after the first, and one row queued behind the pass that drew the stop token.
    assert sum(rows) == len(alone.tokens) - 1 + 1


async def test_a_cancelled_stream_leaves_the_fed_passes_within_two_and_its_lane_frees(autojump_clock):
    backend = FakeBackend(lanes=2, blocks=64, feeds=True, pass_seconds=0.01)  # the consumer acts within a pass
    async with running(backend) as core:
        keep = await core.submit(Request(prompt(5), greedy(30, ignore_eos=True)))
        drop = await core.submit(Request(prompt(6, first=4), greedy(30, ignore_eos=True)))
        kept = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: collect_into(kept, keep))
            seen = 0
            async for _ in drop.events:
                seen += 1
                if seen == 5:
                    break
            await drop.aclose()
        delivered = core.statistics().tokens_out - 30
    assert kept[0].tokens == (await solo(Request(prompt(5), greedy(30, ignore_eos=True)))).tokens
    rows = [w for p in backend.plans if not p.prefills for w in p.work if w.piece.lane == 1]
    # Its rows stop with the two passes already on the device when the cancel came (they run void).
    assert delivered == 5 and len(rows) == delivered - 1 + 2


async def collect_into(out: list, stream) -> None:
    out.append(await collect(stream))
