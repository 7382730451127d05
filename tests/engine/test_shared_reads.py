"""``SharedReads``: identical reads at once share one lookup, never one that started before
they arrived."""

from __future__ import annotations

import asyncio

import pytest
from deferline.engine.testing import SharedReads

pytestmark = pytest.mark.timeout(10)


class Lookups:
    """A look-up that numbers its calls and waits at a gate the test opens one call at a time."""

    def __init__(self) -> None:
        self.calls = 0
        self.started = asyncio.Event()
        self.gate = asyncio.Queue[None]()
        self.fail_next = False

    async def __call__(self, request: str) -> tuple[str, int]:
        self.calls += 1
        number = self.calls
        self.started.set()
        await self.gate.get()
        if self.fail_next:
            self.fail_next = False
            raise LookupError(f"lookup {number} failed")
        return request, number

    async def release_one(self) -> None:
        self.started.clear()
        await self.gate.put(None)


async def test_reads_that_arrive_during_a_lookup_share_the_next_one() -> None:
    look_up = Lookups()
    reads: SharedReads[str, str] = SharedReads(look_up)
    first = asyncio.ensure_future(reads.read("conn", "conn"))
    await look_up.started.wait()
    later = [asyncio.ensure_future(reads.read("conn", "conn")) for _ in range(100)]
    await asyncio.sleep(0)
    await look_up.release_one()
    assert await first == ("conn", 1)
    await look_up.started.wait()  # the next lookup started by itself, for the 100
    await look_up.release_one()
    assert await asyncio.gather(*later) == [("conn", 2)] * 100
    assert (look_up.calls, reads.lookups) == (2, 2)


async def test_other_keys_do_not_share() -> None:
    look_up = Lookups()
    reads: SharedReads[str, str] = SharedReads(look_up)
    a = asyncio.ensure_future(reads.read("a", "a"))
    b = asyncio.ensure_future(reads.read("b", "b"))
    await asyncio.sleep(0)
    await look_up.gate.put(None)
    await look_up.gate.put(None)
    results = await asyncio.gather(a, b)
    assert [request for request, _ in results] == ["a", "b"]
    assert sorted(number for _, number in results) == [1, 2]
    assert reads.lookups == 2


async def test_a_failure_reaches_every_reader_sharing_it_and_the_next_lookup_is_fresh() -> None:
    look_up = Lookups()
    reads: SharedReads[str, str] = SharedReads(look_up)
    look_up.fail_next = True
    sharing = [asyncio.ensure_future(reads.read("conn", "conn")) for _ in range(3)]
    await look_up.started.wait()
    await look_up.release_one()
    outcomes = await asyncio.gather(*sharing, return_exceptions=True)
    assert [str(o) for o in outcomes] == ["lookup 1 failed"] * 3
    again = asyncio.ensure_future(reads.read("conn", "conn"))
    await look_up.started.wait()
    await look_up.release_one()
    assert await again == ("conn", 2)


async def test_a_reader_that_gives_up_leaves_the_lookup_to_the_others() -> None:
    look_up = Lookups()
    reads: SharedReads[str, str] = SharedReads(look_up)
    leaving = asyncio.ensure_future(reads.read("conn", "conn"))
    staying = asyncio.ensure_future(reads.read("conn", "conn"))
    await look_up.started.wait()
    leaving.cancel()
    await look_up.release_one()
    assert await staying == ("conn", 1)
    assert leaving.cancelled()
