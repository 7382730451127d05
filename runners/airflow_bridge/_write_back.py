"""The bridge's event loop: records read from the resume topics while the batch before them is
written back, so that the next batch is all that arrived meanwhile.

A lone event is written at once (nothing is waited for); during a burst each write takes what
came in while the previous one ran, up to ``max_records``, so the many small fetches of a
burst's start become a few large transactions. Each record is read (``read``: decoded) as it
arrives, while the write before it runs. The writes are one at a time and in order, so the
offsets each commits never pass a record not yet written.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    *,
    max_records: int,
    timeout_ms: int = 1000,
    read: Callable[[Any], Any] = lambda record: record,
) -> None:
    """Read records from ``source`` and hand them to ``write`` in batches of at most
    ``max_records`` (each record as ``read`` makes it when it arrives), reading on while a
    write runs; runs until cancelled or a call fails."""
    if max_records < 1:
        raise ValueError(f"max_records must be at least 1, got {max_records}")
    fetch: asyncio.Task[Mapping[Any, Sequence[Any]]] | None = None
    writing: asyncio.Task[None] | None = None
    pending: list[Any] = []
    try:
        while True:
            if fetch is None and len(pending) < max_records:
                fetch = asyncio.ensure_future(
                    source.getmany(timeout_ms=timeout_ms, max_records=max_records - len(pending))
                )
            running = [task for task in (fetch, writing) if task is not None]
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            if fetch is not None and fetch in done:
                batches, fetch = fetch.result(), None
                pending += [read(record) for records in batches.values() for record in records]
            if writing is not None and writing in done:
                finished = writing
                writing = None
                finished.result()  # a failed write ends the loop
            if writing is None and pending:
                writing = asyncio.ensure_future(write(pending))
                pending = []
    finally:
        for task in (fetch, writing):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


class CleanUpSchedule:
    """When the claim loop runs Airflow's ``clean_unused``: not while batches are being written
    (a batch running, or one ended less than ``quiet`` seconds ago), where its ``DELETE`` would
    hold the database thread the write-back waits for, unless it last ran ``longest`` seconds
    ago or more. Times are the caller's clock (the event loop's)."""

    __slots__ = ("_cleaned_at", "_writing", "_written_at", "longest", "quiet")

    def __init__(self, *, quiet: float, longest: float) -> None:
        self.quiet = quiet
        self.longest = longest
        self._writing = False
        self._written_at = float("-inf")
        self._cleaned_at = float("-inf")

    def write_started(self) -> None:
        self._writing = True

    def write_ended(self, now: float) -> None:
        self._writing = False
        self._written_at = now

    def due(self, now: float) -> bool:
        busy = self._writing or now - self._written_at < self.quiet
        return not busy or now - self._cleaned_at >= self.longest

    def cleaned(self, now: float) -> None:
        self._cleaned_at = now
