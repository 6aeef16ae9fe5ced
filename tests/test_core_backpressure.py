"""A stream whose consumer stops reading: its buffer stays bounded, its lane pauses while the others run on,
and once it reads again it gets exactly its solo tokens.

Rules: the real lane core on the fake backend in a test nursery; "stopped" and "idle" are points where every
task is blocked (`wait_all_tasks_blocked`), never sleeps; books checked at the end (`running`).
"""

import trio
import trio.testing

from engine_helpers import collect, greedy, running
from lanes.core.fake import FakeBackend
from lanes.core.stream import Request

BUFFER = 8


async def solo(prompt) -> list[int]:
    async with running(FakeBackend(lanes=2, blocks=64)) as core:
        return (await collect(await core.submit(Request(prompt, greedy(60, ignore_eos=True))))).tokens


async def test_a_consumer_that_stops_reading_pauses_its_stream_with_a_bounded_buffer_and_resumes_it_exactly():
    slow_prompt, fast_prompt = (3, 4, 5), (6, 7)
    expected = await solo(slow_prompt), await solo(fast_prompt)
    async with running(FakeBackend(lanes=2, blocks=64), stream_buffer=BUFFER) as core:
        slow = await core.submit(Request(slow_prompt, greedy(60, ignore_eos=True)))
        fast = await core.submit(Request(fast_prompt, greedy(60, ignore_eos=True)))
        fast_tokens = (await collect(fast)).tokens  # the other stream runs to its end while slow is not read
        await trio.testing.wait_all_tasks_blocked()
        stopped_at = core.statistics()
        buffered = slow.events.buffered
        await trio.testing.wait_all_tasks_blocked()
        assert core.statistics().passes == stopped_at.passes  # no pass runs for a paused stream alone
        assert stopped_at.lanes_busy == 1  # it keeps its lane
        slow_tokens = (await collect(slow)).tokens
    assert BUFFER <= buffered <= BUFFER + 2  # the bound, and at most the passes in flight when it filled
    assert (slow_tokens, fast_tokens) == expected
