"""The pass ahead: while a pass of decoding streams is applied and delivered, the next one already runs.

Rules: the fake backend (its tokens depend on the KV it was given, so a row fed the wrong token or
position changes the output); exact plans and events; outputs equal each stream's solo run; the lane
core's books checked and every block free at the end (engine_helpers.running); under `trio.fail_after`.
"""

import pytest
import trio

from engine_helpers import collect, greedy, prompt, running, solo
from lanes.core.fake import EOS, FakeBackend, _mix, fake_text
from lanes.core.lane_core import LaneCore
from lanes.core.stream import BackendFailed, Failed, Request


def fake_greedy(prompt: tuple[int, ...], n: int, vocab: int = 50) -> list[int]:
    """The fake's greedy tokens computed straight from its rule (each from the whole context), no engine."""
    context = list(prompt)
    for _ in range(n):
        context.append(_mix(*context, 0, 0) % vocab)
    return context[len(prompt):]


class Watching(FakeBackend):
    """Records, as each pass begins, each decode row's (lane, step of its draw, tokens its stream has so far)."""

    core = None

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.seen: list[list[tuple[int, int, int]]] = []

    async def step(self, plan, started=None, following=None):
        rows = [(w.piece.lane, w.sample.step, len(self.core.lanes[w.piece.lane].generated))
                for w in plan.work if w.sample is not None and not plan.prefills]
        self.seen.append(rows)
        return await super().step(plan, started, following)


async def test_a_decode_pass_starts_before_the_one_before_it_is_applied():
    backend = Watching(lanes=4, blocks=64)
    request = Request(prompt(5), greedy(12, ignore_eos=True))
    async with running(backend) as core:
        backend.core = core
        outcome = await collect(await core.submit(request))
    ahead = [rows for rows in backend.seen if rows and all(step == have + 1 for _, step, have in rows)]
    # The first token comes from the prompt pass; of the 11 decode rows, the first is planned after that
    # pass is applied, the other 10 while the pass before them is being applied (fed its drawn token).
    assert len(ahead) == 10 and sum(len(rows) for rows in backend.seen) == 11
    assert outcome.tokens == fake_greedy(request.prompt, 12)


async def test_a_stream_a_stop_string_ends_gets_one_void_row_and_no_more_events():
    first = await solo(Request(prompt(4), greedy(12, ignore_eos=True)))
    assert first.tokens == fake_greedy(prompt(4), 12)
    third = first.text.split()[2]  # the fake's text is "t<id> " a token: stop at the third token's text
    backend = Watching(lanes=2, blocks=64)
    request = Request(prompt(4), greedy(12, ignore_eos=True, stop=(third,)))
    async with running(backend) as core:
        backend.core = core
        outcome = await collect(await core.submit(request))
    assert outcome.last.reason == "stop" and outcome.tokens == first.tokens[: len(outcome.tokens)]
    assert outcome.text == first.text[: first.text.index(third)]
    rows = [len(rows) for rows in backend.seen if rows]
    # Rows fed tokens 1.. up to the one whose text held the stop string, and one more that ran void.
    assert sum(rows) == len(outcome.tokens)


async def test_nothing_runs_ahead_while_a_request_waits_for_a_lane():
    backend = Watching(lanes=1, blocks=64)
    async with running(backend) as core:
        backend.core = core
        first = await core.submit(Request(prompt(5), greedy(6, ignore_eos=True)))
        second = await core.submit(Request(prompt(5, 3), greedy(6, ignore_eos=True)))
        with trio.fail_after(10):
            await collect(first)
            await collect(second)
    # The first stream's passes are planned after the one before is applied: the queued stream must not
    # wait a pass longer for the lane the first one frees.
    waiting = backend.seen[: 6]
    assert all(step == have for rows in waiting for _, step, have in rows)


class CallsBack(FakeBackend):
    """Calls `started` as a trio callback, as a runner's worker thread does once it has launched a pass,
    and returns only once the callback has run."""

    async def step(self, plan, started=None, following=None):
        if started is None:
            return await super().step(plan, None, following)
        token, called = trio.lowlevel.current_trio_token(), trio.Event()

        def callback():
            try:
                started()
            finally:
                called.set()

        result = await super().step(plan, lambda: token.run_sync_soon(callback), following)
        await called.wait()
        return result


def breaking_text(at: int):
    """The fake's text, whose assembler fails at its stream's `at`-th token: an error while settling."""

    def make(prompt, sampling):
        text = fake_text(prompt, sampling)
        push, count = text.push, [0]

        def failing(token):
            count[0] += 1
            if count[0] == at:
                raise ZeroDivisionError("the text assembler broke")
            return push(token)

        text.push = failing
        return text

    return make


@pytest.mark.parametrize("backend_type", [FakeBackend, CallsBack], ids=["in the stepping task", "as a trio callback"])
async def test_an_error_while_a_pass_is_settled_ahead_is_raised_by_the_lane_core_itself(backend_type):
    backend = backend_type(lanes=2, blocks=64)
    core = LaneCore(backend, breaking_text(6), [EOS])  # the 6th token is settled while the 7th pass runs
    with trio.fail_after(30):
        with pytest.RaisesGroup(pytest.RaisesExc(ZeroDivisionError, match="^the text assembler broke$"), flatten_subgroups=True):
            async with trio.open_nursery() as nursery:
                await nursery.start(core.run)
                stream = await core.submit(Request(prompt(5), greedy(12, ignore_eos=True)))
                await trio.sleep_forever()
        outcome = await collect(stream)
    assert isinstance(outcome.last, Failed) and len(outcome.tokens) == 5
    core.check_integrity()


async def test_a_device_lost_in_a_pass_run_ahead_fails_the_stream_and_stops_the_core():
    backend = Watching(lanes=2, blocks=64, fail_at=6)  # pass 6: the 5th decode pass, planned ahead
    core = LaneCore(backend, fake_text, [EOS])
    backend.core = core
    with trio.fail_after(30):
        with pytest.RaisesGroup(pytest.RaisesExc(BackendFailed, match="^the model pass failed: RuntimeError: the fake device was lost$")):
            async with trio.open_nursery() as nursery:
                await nursery.start(core.run)
                stream = await core.submit(Request(prompt(5), greedy(12, ignore_eos=True)))
                await trio.sleep_forever()
        outcome = await collect(stream)
    assert [step - have for rows in backend.seen[3:5] for _, step, have in rows] == [1, 1]  # passes 4, 5 ran ahead
    assert isinstance(outcome.last, Failed) and isinstance(outcome.last.error, BackendFailed)
    assert outcome.tokens == fake_greedy(prompt(5), 12)[: len(outcome.tokens)] and len(outcome.tokens) == 5
    core.check_integrity()
    assert core.pool.free == core.pool.total and not backend.bound
