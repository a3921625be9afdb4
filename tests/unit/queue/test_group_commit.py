"""GroupCommit: callers that ask while a statement is in flight share the next one."""

from __future__ import annotations

import asyncio

import pytest
from analysis_queue import errors
from analysis_queue.queue.group_commit import GroupCommit, QueueTimeout, in_batch


async def _turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


class Recorder:
    """A flush that records its batches and can be held open."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_on: int | None = None

    async def __call__(self, keys: list[int]) -> dict[int, str]:
        self.batches.append(list(keys))
        await self.gate.wait()
        if self.fail_on is not None and self.fail_on in keys:
            raise RuntimeError("statement failed")
        return {k: f"v{k}" for k in keys if k % 2 == 0}  # odd keys: "no row"


async def test_keys_of_one_loop_turn_go_out_together() -> None:
    flush = Recorder()
    group: GroupCommit[int, str] = GroupCommit(flush)
    results = await asyncio.gather(*(group.submit(k) for k in range(6)))
    assert results == ["v0", None, "v2", None, "v4", None]
    assert flush.batches == [[0, 1, 2, 3, 4, 5]]
    assert (group.batches, group.keys) == (1, 6)


async def test_keys_submitted_during_a_flush_share_the_next_one() -> None:
    flush = Recorder()
    flush.gate.clear()
    group: GroupCommit[int, str] = GroupCommit(flush)
    first = asyncio.create_task(group.submit(0))
    await _turns()
    assert flush.batches == [[0]]  # in flight, held open
    later = [asyncio.create_task(group.submit(k)) for k in (2, 4, 6)]
    await _turns()
    assert flush.batches == [[0]], "nothing goes out while a statement is in flight"
    flush.gate.set()
    assert await first == "v0"
    assert [await t for t in later] == ["v2", "v4", "v6"]
    assert flush.batches == [[0], [2, 4, 6]]


async def test_batches_are_capped_and_counted() -> None:
    flush = Recorder()
    sizes: list[int] = []
    group: GroupCommit[int, str] = GroupCommit(flush, max_batch=4, on_batch=sizes.append)
    await asyncio.gather(*(group.submit(k) for k in range(10)))
    assert flush.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert sizes == [4, 4, 2]


async def test_a_failed_statement_fails_its_batch_only() -> None:
    flush = Recorder()
    flush.gate.clear()
    flush.fail_on = 0
    group: GroupCommit[int, str] = GroupCommit(flush)
    doomed = asyncio.create_task(group.submit(0))
    await _turns()
    fine = asyncio.create_task(group.submit(2))
    await _turns()
    flush.gate.set()
    with pytest.raises(RuntimeError, match="statement failed"):
        await doomed
    assert await fine == "v2"
    # And the group keeps working after a failure.
    assert await group.submit(4) == "v4"


async def test_a_cancelled_caller_does_not_break_its_batch() -> None:
    flush = Recorder()
    flush.gate.clear()
    group: GroupCommit[int, str] = GroupCommit(flush)
    gone = asyncio.create_task(group.submit(0))
    stays = asyncio.create_task(group.submit(2))
    await _turns()
    gone.cancel()
    flush.gate.set()
    assert await stays == "v2"
    with pytest.raises(asyncio.CancelledError):
        await gone


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError):
        GroupCommit(Recorder(), max_batch=0)


async def test_a_failing_batch_callback_does_not_strand_the_callers() -> None:
    def broken(_n: int) -> None:
        raise RuntimeError("metrics are broken")

    group: GroupCommit[int, str] = GroupCommit(Recorder(), on_batch=broken)
    assert await asyncio.wait_for(asyncio.gather(group.submit(0), group.submit(2)), 1) == [
        "v0",
        "v2",
    ]
    assert await asyncio.wait_for(group.submit(4), 1) == "v4", "and the group goes on"


async def test_a_caller_cancelled_before_its_batch_is_not_written() -> None:
    flush = Recorder()
    flush.gate.clear()
    group: GroupCommit[int, str] = GroupCommit(flush)
    first = asyncio.create_task(group.submit(0))
    await _turns()  # 0 in flight
    gone = asyncio.create_task(group.submit(2))
    stays = asyncio.create_task(group.submit(4))
    await _turns()
    gone.cancel()
    flush.gate.set()
    assert (await first, await stays) == ("v0", "v4")
    assert flush.batches == [[0], [4]], "the cancelled caller's key was written"


async def test_idle_waits_for_the_statement_in_flight() -> None:
    flush = Recorder()
    flush.gate.clear()
    group: GroupCommit[int, str] = GroupCommit(flush)
    caller = asyncio.create_task(group.submit(0))
    await _turns()
    assert flush.batches == [[0]], "the statement is being written"
    caller.cancel()  # its owner is gone; the statement is still being written
    idle = asyncio.create_task(group.idle())
    await _turns()  # no I/O here: a fixed number of loop turns runs everything that can run
    assert not idle.done()
    flush.gate.set()
    await asyncio.wait_for(idle, 1)
    assert flush.batches == [[0]]


async def test_a_caller_may_bound_its_wait_for_a_place_but_not_for_its_answer() -> None:
    flush = Recorder()
    flush.gate.clear()
    group: GroupCommit[int, str] = GroupCommit(flush)
    in_flight = asyncio.create_task(group.submit(0, queue_timeout_s=0.05))
    await asyncio.sleep(0)  # 0 goes out at once and is held open
    queued = asyncio.create_task(group.submit(2, queue_timeout_s=0.05))
    with pytest.raises(QueueTimeout):
        await queued  # it never got a place: nothing was written for it
    flush.gate.set()
    assert await in_flight == "v0", "a key in a statement waits for that statement's answer"
    assert flush.batches == [[0]]
    assert await group.submit(4, queue_timeout_s=0.05) == "v4"


async def test_in_batch_answers_each_request_fails_with_its_batch_and_bounds_the_wait() -> None:
    gate, writing = asyncio.Event(), asyncio.Event()

    async def flush(keys: list[int]) -> dict[int, str]:
        if 4 in keys:
            raise RuntimeError("the batch failed")
        if 5 in keys:
            writing.set()
            await gate.wait()
        return {k: f"v{k}" for k in keys if k != 3}

    group: GroupCommit[int, str] = GroupCommit(flush)
    assert await asyncio.gather(*(in_batch(group, k, 5) for k in (1, 2, 3))) == ["v1", "v2", None]
    with pytest.raises(RuntimeError, match="the batch failed"):
        await in_batch(group, 4, 5)  # no request is decided outside its batch
    held = asyncio.create_task(in_batch(group, 5, 5))
    await writing.wait()
    with pytest.raises(errors.DatabaseUnavailable):
        await in_batch(group, 6, 0.05)  # no place in a statement in time: a 503, nothing written
    gate.set()
    assert await held == "v5"


async def test_keys_behind_a_stalled_statement_go_out_beside_it_up_to_a_bound() -> None:
    """A statement held open (its batch waits for a lock someone holds) delays only its own
    keys: after ``stalled_after_s`` the keys behind it go out in a statement of their own, and
    never more statements than ``max_in_flight`` at once."""
    stuck = asyncio.Event()

    async def flush(keys: list[int]) -> dict[int, str]:
        if any(k < 0 for k in keys):
            await stuck.wait()
        return {k: f"v{k}" for k in keys}

    group: GroupCommit[int, str] = GroupCommit(flush, stalled_after_s=0.01, max_in_flight=2)
    held = asyncio.create_task(group.submit(-1))
    await _turns()
    assert await asyncio.wait_for(group.submit(1), 5) == "v1", "it went out beside the stuck one"
    second = asyncio.create_task(group.submit(-2))  # beside the first: both stuck now
    await _turns()
    third = asyncio.create_task(group.submit(3))
    await _turns()
    # Two statements in flight at most: nothing is even scheduled to send it beside them.
    assert group._timer is None and not third.done()
    stuck.set()
    assert await asyncio.gather(held, second, third) == ["v-1", "v-2", "v3"]
    await group.idle()
