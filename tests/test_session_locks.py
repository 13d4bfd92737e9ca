"""Requests of one explicit session run in arrival order; a client that leaves while queued leaks nothing."""
import asyncio

from clawd.serving.completion import _SessionLocks

KEY = ("alice", "s1")


async def test_arrival_order_and_cleanup():
    locks, order = _SessionLocks(), []

    async def request(i):
        await locks.acquire(KEY)
        try:
            order.append(i)
            await asyncio.sleep(0)
        finally:
            locks.release(KEY)

    await asyncio.gather(*(request(i) for i in range(5)))
    assert order == [0, 1, 2, 3, 4]
    assert locks._locks == {}


async def test_cancelled_waiter_gives_up_its_place():
    locks = _SessionLocks()
    await locks.acquire(KEY)
    waiter = asyncio.ensure_future(locks.acquire(KEY))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    locks.release(KEY)
    assert locks._locks == {}
