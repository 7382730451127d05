"""The bridge's event loop: records read from the resume topics while batches before them are
written back, so that the next batch is all that arrived meanwhile.

A lone event is written at once (nothing is waited for); during a burst each write takes what
came in while the writes before it ran, up to ``max_records``, so the many small fetches of a
burst's start become a few large transactions. Each record is read (``read``: decoded) as it
arrives. Up to ``writers`` batches are written at once (each in its own database session): a
write starts at once when none runs, and beside others only with a backlog of
``max_records / writers`` records or more, so the start of a burst still gathers into a few
large batches (a small batch costs the database nearly as much as a large one). Offsets are
committed in the order the batches were read, each once it and every batch before it are
written, so a committed offset never passes a record not yet written.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

__all__ = ["CleanUpSchedule", "RecordSource", "write_back_loop"]


class RecordSource(Protocol):
    """What the loop needs of a consumer (``AIOKafkaConsumer.getmany``)."""

    async def getmany(
        self, *partitions: Any, timeout_ms: int = ..., max_records: int | None = ...
    ) -> Mapping[Any, Sequence[Any]]: ...


async def write_back_loop(
    source: RecordSource,
    write: Callable[[list[Any]], Awaitable[None]],
    commit: Callable[[list[Any]], Awaitable[None]],
    *,
    max_records: int,
    writers: int = 1,
    timeout_ms: int = 1000,
    read: Callable[[Any], Any] = lambda record: record,
) -> None:
    """Read records from ``source`` and hand them to ``write`` in batches of at most
    ``max_records`` (each record as ``read`` makes it when it arrives), up to ``writers``
    batches at once given a backlog, reading on meanwhile; ``commit`` each written batch in
    the order read.
    Runs until cancelled or a call fails."""
    if max_records < 1 or writers < 1:
        raise ValueError(
            f"max_records and writers must be at least 1, got {max_records}, {writers}"
        )
    fetch: asyncio.Task[Mapping[Any, Sequence[Any]]] | None = None
    writing: deque[tuple[asyncio.Task[None], list[Any]]] = deque()
    pending: list[Any] = []
    try:
        while True:
            if fetch is None and len(pending) < max_records:
                fetch = asyncio.ensure_future(
                    source.getmany(timeout_ms=timeout_ms, max_records=max_records - len(pending))
                )
            running: list[asyncio.Future[Any]] = [t for t, _ in writing if not t.done()]
            if fetch is not None:
                running.append(fetch)
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            if fetch is not None and fetch in done:
                batches, fetch = fetch.result(), None
                pending += [read(record) for records in batches.values() for record in records]
            for task, _ in writing:
                if task.done():
                    task.result()  # a failed write ends the loop
            while writing and writing[0][0].done():
                await commit(writing.popleft()[1])
            running_writes = sum(not task.done() for task, _ in writing)
            if pending and (
                not running_writes
                or (running_writes < writers and len(pending) >= max_records // writers)
            ):
                writing.append((asyncio.ensure_future(write(pending)), pending))
                pending = []
    finally:
        left: list[asyncio.Future[Any] | None] = [fetch, *(t for t, _ in writing)]
        for future in left:
            if future is not None and not future.done():
                future.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await future


class CleanUpSchedule:
    """When the claim loop runs Airflow's ``clean_unused``: not while batches are being written
    (a batch running, or one ended less than ``quiet`` seconds ago), where its ``DELETE`` would
    compete with the write-back for the database, unless it last ran ``longest`` seconds ago
    or more. Times are the caller's clock (the event loop's)."""

    __slots__ = ("_cleaned_at", "_writing", "_written_at", "longest", "quiet")

    def __init__(self, *, quiet: float, longest: float) -> None:
        self.quiet = quiet
        self.longest = longest
        self._writing = 0
        self._written_at = float("-inf")
        self._cleaned_at = float("-inf")

    def write_started(self) -> None:
        self._writing += 1

    def write_ended(self, now: float) -> None:
        self._writing -= 1
        self._written_at = now

    def due(self, now: float) -> bool:
        busy = self._writing or now - self._written_at < self.quiet
        return not busy or now - self._cleaned_at >= self.longest

    def cleaned(self, now: float) -> None:
        self._cleaned_at = now
