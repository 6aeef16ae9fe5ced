"""The decode gate: slots and bytes granted strictly in arrival order, given back on every exit, a cancelled
waiter out of the queue at once; exact counts after every step.

Rules: no threads and no sleeps; each step runs until every task is blocked
(`trio.testing.wait_all_tasks_blocked`), then the grants so far are read and the gate's integrity checked.
"""

import pytest
import trio
import trio.testing

from lanes.http.decode_gate import DecodeGate, GateStatistics


class Holder:
    """A task that holds `cost` on the gate until `release` is set, noting when it was granted."""

    def __init__(self, gate: DecodeGate, name: str, cost: int, log: list[str]) -> None:
        self.gate, self.name, self.cost, self.log = gate, name, cost, log
        self.release = trio.Event()  # set by the test when this holder may give its grant back
        self.scope = trio.CancelScope()

    async def run(self) -> None:
        with self.scope:
            async with self.gate.hold(self.cost):
                self.log.append(self.name)
                await self.release.wait()


async def settle(gate: DecodeGate) -> None:
    await trio.testing.wait_all_tasks_blocked()
    gate.check_integrity()


async def test_slots_are_granted_in_arrival_order():
    gate, log = DecodeGate(budget_bytes=100, slots=1), []
    holders = [Holder(gate, name, 10, log) for name in "abc"]
    async with trio.open_nursery() as nursery:
        for holder in holders:
            nursery.start_soon(holder.run)
            await settle(gate)
        assert log == ["a"] and gate.statistics() == GateStatistics(100, 1, 10, 1, 2)
        for done, expected in zip(holders, (["a", "b"], ["a", "b", "c"], ["a", "b", "c"])):
            done.release.set()
            await settle(gate)
            assert log == expected
    assert gate.statistics() == GateStatistics(100, 1, 0, 0, 0)


async def test_the_head_waits_for_bytes_and_is_never_overtaken():
    gate, log = DecodeGate(budget_bytes=100, slots=4), []
    big, large, small = Holder(gate, "big", 60, log), Holder(gate, "large", 50, log), Holder(gate, "small", 10, log)
    async with trio.open_nursery() as nursery:
        for holder in (big, large, small):
            nursery.start_soon(holder.run)
            await settle(gate)
        # small would fit beside big, but large came first
        assert log == ["big"] and gate.statistics() == GateStatistics(100, 4, 60, 1, 2)
        big.release.set()
        await settle(gate)
        # both granted in one step (which task runs first is the scheduler's choice)
        assert sorted(log[1:]) == ["large", "small"] and gate.statistics() == GateStatistics(100, 4, 60, 2, 0)
        large.release.set()
        small.release.set()
    assert gate.statistics().held_bytes == 0


async def test_a_cancelled_head_leaves_the_queue_and_the_next_is_granted():
    gate, log = DecodeGate(budget_bytes=100, slots=4), []
    big, large, small = Holder(gate, "big", 60, log), Holder(gate, "large", 50, log), Holder(gate, "small", 10, log)
    async with trio.open_nursery() as nursery:
        for holder in (big, large, small):
            nursery.start_soon(holder.run)
            await settle(gate)
        large.scope.cancel()
        await settle(gate)
        assert log == ["big", "small"] and gate.statistics() == GateStatistics(100, 4, 70, 2, 0)
        big.release.set()
        small.release.set()
    assert gate.statistics() == GateStatistics(100, 4, 0, 0, 0)


async def test_a_holder_that_fails_gives_its_grant_back():
    gate = DecodeGate(budget_bytes=100, slots=1)
    with pytest.raises(KeyError):
        async with gate.hold(40):
            assert gate.statistics().held_bytes == 40
            raise KeyError("decoding failed")
    assert gate.statistics() == GateStatistics(100, 1, 0, 0, 0)


async def test_a_request_of_many_parts_lets_another_in_after_each_part():
    # one request holds one part at a time; another client's part goes right after the part in progress
    gate, log = DecodeGate(budget_bytes=100, slots=1), []
    steps = [trio.Event() for _ in range(4)]  # set by the test: each lets one part of the many finish

    async def many() -> None:
        for i, step in enumerate(steps):
            async with gate.hold(30):
                log.append(f"many{i}")
                await step.wait()

    single = Holder(gate, "single", 5, log)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(many)
        await settle(gate)
        nursery.start_soon(single.run)
        await settle(gate)
        steps[0].set()
        await settle(gate)
        assert log == ["many0", "single"]
        single.release.set()
        for step in steps[1:]:
            step.set()
    assert log == ["many0", "single", "many1", "many2", "many3"]


def test_a_cost_over_the_budget_never_fits():
    gate = DecodeGate(budget_bytes=100, slots=2)
    assert gate.fits(100) and not gate.fits(101)
    with pytest.raises(ValueError):
        DecodeGate(budget_bytes=0)
