"""A stream's event channel behaves as the trio memory channel it replaces, for one sender and one
receiver: order, end of channel, a receiver gone, cancellation, checkpoints."""

import pytest
import trio
import trio.testing

from lanes.core.events import EventChannel


async def test_events_arrive_in_order_and_iteration_ends_when_the_sender_closes():
    channel = EventChannel()
    for i in range(3):
        channel.send_nowait(i)
    channel.close_sender()
    with trio.fail_after(5):
        assert [e async for e in channel] == [0, 1, 2]
        with pytest.raises(trio.EndOfChannel):
            await channel.receive()
    with pytest.raises(trio.EndOfChannel):
        channel.receive_nowait()


async def test_a_waiting_receiver_is_woken_by_a_send_and_by_the_end():
    channel = EventChannel()
    got = []

    async def consume():
        async for event in channel:
            got.append(event)
        got.append("end")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await trio.testing.wait_all_tasks_blocked()
            channel.send_nowait("a")
            await trio.testing.wait_all_tasks_blocked()
            assert got == ["a"]
            channel.send_nowait("b")
            channel.close_sender()
    assert got == ["a", "b", "end"]


async def test_a_receiver_that_closes_breaks_the_sender_and_drops_what_was_unread():
    channel = EventChannel()
    channel.send_nowait(1)
    with trio.fail_after(5):
        await channel.aclose()
    assert channel.receiver_closed
    with pytest.raises(trio.BrokenResourceError):
        channel.send_nowait(2)
    with pytest.raises(trio.ClosedResourceError):
        channel.receive_nowait()
    channel.close_sender()  # the lane core closes its end as usual: no error


async def test_closing_wakes_a_receiver_blocked_in_another_task():
    channel = EventChannel()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            async def consume():
                with pytest.raises(trio.ClosedResourceError):
                    await channel.receive()

            nursery.start_soon(consume)
            await trio.testing.wait_all_tasks_blocked()
            channel.close()


async def test_a_cancelled_receive_leaves_no_waiter_and_the_event_is_kept():
    channel = EventChannel()
    with trio.fail_after(5):
        with trio.move_on_after(0) as scope:
            await channel.receive()
        assert scope.cancelled_caught
        channel.send_nowait("kept")  # no task is woken: it is buffered
        assert await channel.receive() == "kept"


async def test_one_receiver_at_a_time():
    channel = EventChannel()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(channel.receive)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await channel.receive()
            channel.send_nowait("x")


async def test_receive_is_a_checkpoint_even_when_an_event_is_waiting():
    channel = EventChannel()
    channel.send_nowait(1)
    with trio.fail_after(5):
        with trio.testing.assert_checkpoints():
            assert await channel.receive() == 1
        with trio.CancelScope() as scope:
            scope.cancel()
            channel.send_nowait(2)
            with pytest.raises(trio.Cancelled):
                await channel.receive()  # cancelled before taking it
        assert channel.receive_nowait() == 2


def test_a_sender_that_closed_cannot_send():
    channel = EventChannel()
    channel.close_sender()
    channel.close_sender()  # idempotent
    with pytest.raises(trio.ClosedResourceError):
        channel.send_nowait(1)


async def test_drain_takes_every_buffered_event_in_order_and_resumes_a_full_stream_once():
    drained = []
    channel = EventChannel(capacity=4, on_drain=lambda: drained.append(True))
    assert [channel.send_nowait(i) for i in range(5)] == [False, False, False, True, False]
    assert channel.drain() == [0, 1, 2, 3, 4]
    assert (channel.drain(), drained, channel.buffered) == ([], [True], 0)
    channel.send_nowait(5)
    channel.close_sender()
    assert channel.drain() == [5]
    assert channel.drain() == []  # none after the last, where receive gives EndOfChannel
    with trio.fail_after(5), pytest.raises(trio.EndOfChannel):
        await channel.receive()
    channel.close()
    with pytest.raises(trio.ClosedResourceError):
        channel.drain()
