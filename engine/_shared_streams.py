"""One poll per shared stream in a process: Airflow 3.3's ``BaseEventTrigger.shared_stream_key``.

Airflow's event triggers that watch one resource each (a directory, a queue) may declare that
siblings share it: triggers whose ``shared_stream_key()`` compare equal get one
``open_shared_stream(kwargs)`` between them, each reading it through its own
``filter_shared_stream(stream)``. :class:`SharedStreams` is that fan-out for the triggers of one
process (a deferline triggerer): the first subscriber of a key starts the stream in a task of
its own, every raw item goes to each subscriber's queue (bounded: a subscriber behind by that
many items holds the stream back rather than lose one), a subscriber that joins later sees
the items from then on, the last one to leave cancels the stream, and a stream that ends or
raises ends every subscriber with that error (Airflow's contract: "yield forever, or raise").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any, Final

__all__ = ["SharedStreamEnded", "SharedStreams", "shared_streams"]

QUEUE_SIZE: Final = 100
"""Items a subscriber may be behind before the stream waits for it."""


class SharedStreamEnded(Exception):
    """A shared stream returned: its triggers end with this (they are started again)."""


_END: Final = object()
"""Put after the last item when the stream ended (when the queue has room: else the
subscriber finds ``error`` once it has read what is queued)."""


class _Group:
    """One shared stream and its subscribers' queues."""

    def __init__(self, opener: Callable[[], AsyncIterator[Any]]) -> None:
        self.subscribers: set[asyncio.Queue[Any]] = set()
        self.error: BaseException | None = None
        self.task = asyncio.get_running_loop().create_task(
            self._pump(opener), name="deferline-shared-stream"
        )

    async def _pump(self, opener: Callable[[], AsyncIterator[Any]]) -> None:
        try:
            async for item in opener():
                for queue in list(self.subscribers):
                    await queue.put(item)
            self.error = SharedStreamEnded("the shared stream returned (it must yield or raise)")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every subscriber's trigger fails with it
            self.error = exc
        for queue in list(self.subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(_END)


class SharedStreams:
    """The shared streams of one process, by key. Owns ``_groups``."""

    def __init__(self, queue_size: int = QUEUE_SIZE) -> None:
        self._queue_size = queue_size
        self._groups: dict[Hashable, _Group] = {}

    def __len__(self) -> int:
        """Streams open now."""
        return len(self._groups)

    async def subscribe(
        self, key: Hashable, opener: Callable[[], AsyncIterator[Any]]
    ) -> AsyncIterator[Any]:
        """The items of the stream ``key`` from now on; ``opener`` starts it when no
        subscriber has it open. Leaving (the iterator closed) unsubscribes."""
        group = self._groups.get(key)
        if group is None or group.task.done():
            group = self._groups[key] = _Group(opener)
        queue: asyncio.Queue[Any] = asyncio.Queue(self._queue_size)
        group.subscribers.add(queue)
        try:
            while True:
                if queue.empty() and group.error is not None:
                    raise group.error
                item = await queue.get()
                if item is _END:
                    assert group.error is not None
                    raise group.error
                yield item
        finally:
            group.subscribers.discard(queue)
            if not group.subscribers and self._groups.get(key) is group:
                del self._groups[key]
                group.task.cancel()


_streams: SharedStreams | None = None


def shared_streams() -> SharedStreams:
    """This process's shared streams (one set, as a triggerer has one supervisor)."""
    global _streams
    if _streams is None:
        _streams = SharedStreams()
    return _streams
