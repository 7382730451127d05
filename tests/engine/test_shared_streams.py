"""One poll per shared stream in a process (Airflow's shared_stream_key), no Airflow needed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from deferline.engine.testing import SharedStreamEnded, SharedStreams


class Source:
    """A stream the test feeds item by item; counts how often it was opened."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0
        self.items: asyncio.Queue[Any] = asyncio.Queue()

    async def open(self) -> AsyncIterator[Any]:
        self.opened += 1
        try:
            while True:
                item = await self.items.get()
                if isinstance(item, BaseException):
                    raise item
                if item is StopAsyncIteration:
                    return
                yield item
        finally:
            self.closed += 1


async def take(stream: AsyncIterator[Any], n: int) -> list[Any]:
    return [await asyncio.wait_for(anext(stream), 5) for _ in range(n)]


async def test_siblings_share_one_stream_and_each_sees_every_item() -> None:
    streams, source = SharedStreams(), Source()
    a = streams.subscribe("k", source.open)
    b = streams.subscribe("k", source.open)
    first_a = asyncio.ensure_future(anext(a))
    first_b = asyncio.ensure_future(anext(b))
    for item in (1, 2, 3):
        source.items.put_nowait(item)
    assert [await first_a, *(await take(a, 2))] == [1, 2, 3]
    assert [await first_b, *(await take(b, 2))] == [1, 2, 3]
    assert source.opened == 1
    assert len(streams) == 1
    # A latecomer sees what comes from now on; another key gets a stream of its own.
    c = streams.subscribe("k", source.open)
    later = asyncio.ensure_future(anext(c))
    await asyncio.sleep(0)
    source.items.put_nowait(4)
    assert await later == 4
    assert await take(a, 1) == [4]
    # The last one to leave closes it.
    for stream in (a, b, c):
        await stream.aclose()  # type: ignore[attr-defined]
    await asyncio.sleep(0)
    assert len(streams) == 0
    assert source.closed == 1


@pytest.mark.parametrize("end", [RuntimeError("upstream gone"), StopAsyncIteration])
async def test_a_stream_that_raises_or_returns_ends_every_subscriber(end: Any) -> None:
    streams, source = SharedStreams(queue_size=2), Source()
    a = streams.subscribe("k", source.open)
    b = streams.subscribe("k", source.open)
    pending = [asyncio.ensure_future(anext(s)) for s in (a, b)]
    source.items.put_nowait("x")
    assert [await p for p in pending] == ["x", "x"]
    source.items.put_nowait(end)
    expected = RuntimeError if isinstance(end, RuntimeError) else SharedStreamEnded
    for stream in (a, b):
        with pytest.raises(expected):
            await asyncio.wait_for(anext(stream), 5)
    # The next subscriber opens it anew.
    again = streams.subscribe("k", source.open)
    fresh = asyncio.ensure_future(anext(again))
    await asyncio.sleep(0)
    source.items.put_nowait("y")
    assert await fresh == "y"
    assert source.opened == 2
    await again.aclose()  # type: ignore[attr-defined]


async def test_a_slow_subscriber_holds_the_stream_back_and_loses_nothing() -> None:
    """Past ``queue_size`` items behind, the stream waits for the laggard (the other
    subscribers with it): nothing is dropped."""
    streams, source = SharedStreams(queue_size=2), Source()
    fast = streams.subscribe("k", source.open)
    slow = streams.subscribe("k", source.open)

    async def late(stream: AsyncIterator[Any], n: int) -> list[Any]:
        got = [await asyncio.wait_for(anext(stream), 5)]
        await asyncio.sleep(0.2)  # the stream is held back meanwhile
        return got + await take(stream, n - 1)

    readers = asyncio.gather(take(fast, 6), late(slow, 6))
    for item in range(6):
        source.items.put_nowait(item)
    assert list(await readers) == [list(range(6)), list(range(6))]
    assert source.opened == 1
    for stream in (fast, slow):
        await stream.aclose()  # type: ignore[attr-defined]
