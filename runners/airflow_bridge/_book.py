"""Which claimed rows the bridge has handed to deferline, and what became of them. Pure."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from deferline.schemas import CancelRequest, DeferRequest, WatchRequest

from ._rows import RowRef

__all__ = ["HandedRow", "RowBook", "Stop"]


@dataclass(frozen=True, slots=True)
class Stop:
    """What stops the trigger of a row Airflow deleted: a CancelRequest for a deferral (its
    task is told), a tombstone for a standing watch (``cancel`` None: nothing waits on it)."""

    trigger_id: str
    queue: str | None
    cancel: CancelRequest | None


@dataclass(slots=True)
class HandedRow:
    """A claimed row: published as ``request``, or failed in Airflow (``request`` None)."""

    ref: RowRef
    request: DeferRequest | WatchRequest | None
    applied: bool = False
    """An event of it was written back by this bridge."""


class RowBook:
    """The rows this bridge holds, by row id.

    A row leaves the book when it is no longer this bridge's: deleted by Airflow, or claimed
    by another triggerer (this one was taken for dead). Only a deleted row whose trigger
    still runs for all this bridge knows gets a cancel: the task was cleared, marked or its
    run deleted. A row another triggerer claimed is left alone: the other publishes the same
    trigger id, and a cancel could land after its request.
    """

    def __init__(self) -> None:
        self._rows: dict[int, HandedRow] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def unseen(self, owned: Iterable[int]) -> set[int]:
        """Rows Airflow says are ours that the bridge has not handled yet."""
        return {row_id for row_id in owned if row_id not in self._rows}

    def vanished(self, owned: Collection[int]) -> set[int]:
        """Rows in the book that Airflow no longer says are ours."""
        return {row_id for row_id in self._rows if row_id not in owned}

    def holds(self, ref: RowRef) -> bool:
        """The row ``ref`` (that id, made at that moment) is in the book."""
        row = self._rows.get(ref.row_id)
        return row is not None and row.ref == ref

    def handed(self, ref: RowRef, request: DeferRequest | WatchRequest | None) -> None:
        self._rows[ref.row_id] = HandedRow(ref, request)

    def applied(self, refs: Iterable[RowRef]) -> None:
        """Events of these rows were written back (rows of other bridges are ignored)."""
        for ref in refs:
            row = self._rows.get(ref.row_id)
            if row is not None and row.ref == ref:
                row.applied = True

    def settle(self, vanished: Collection[int], deleted: Collection[int]) -> list[Stop]:
        """Drop ``vanished`` rows; the stops owed for those Airflow ``deleted`` (a watch
        whatever its events; a deferral whose event this bridge did not write back)."""
        stops: list[Stop] = []
        for row_id in vanished:
            row = self._rows.pop(row_id, None)
            if row is None or row_id not in deleted or row.request is None:
                continue
            request = row.request
            if isinstance(request, WatchRequest):
                stops.append(Stop(request.trigger_id, request.queue, None))
                continue
            if row.applied:
                continue
            cancel = CancelRequest(
                trigger_id=request.trigger_id,
                task=request.task,
                defer_seq=request.defer_seq,
                reason="the task instance no longer waits on this trigger in Airflow",
            )
            stops.append(Stop(request.trigger_id, request.queue, cancel))
        return stops
