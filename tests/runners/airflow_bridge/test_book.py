"""The bridge's book of handed rows: which vanished rows owe deferline a cancel or, for a
standing watch, a tombstone."""

from __future__ import annotations

import datetime as dt

from deferline.runners.airflow_bridge import bridge_trigger_id
from deferline.runners.airflow_bridge.testing import RowBook, RowRef
from deferline.schemas import DeferRequest, TaskKey, WatchRequest

T0 = dt.datetime(2026, 11, 25, tzinfo=dt.UTC)


def handed(book: RowBook, row_id: int, queue: str | None = None) -> RowRef:
    ref = RowRef.of(row_id, T0)
    request = DeferRequest(
        trigger_id=bridge_trigger_id(ref),
        task=TaskKey(dag_id="d", task_id=f"t{row_id}", run_id="r"),
        classpath="x.Trigger",
        queue=queue,
    )
    book.handed(ref, request)
    return ref


def test_only_rows_airflow_deleted_unapplied_are_cancelled() -> None:
    book = RowBook()
    handed(book, 1)
    applied = handed(book, 2)
    handed(book, 3, queue="fast")
    handed(book, 4)
    book.handed(RowRef.of(5, T0), None)  # failed in Airflow: nothing runs in deferline
    book.applied([applied, RowRef.of(99, T0)])
    assert book.unseen({1, 2, 6}) == {6}
    vanished = book.vanished({4})
    assert vanished == {1, 2, 3, 5}
    # Row 1 was claimed by another triggerer (still exists): left alone.
    stops = book.settle(vanished, deleted={2, 3, 5})
    assert [(s.trigger_id, s.queue) for s in stops] == [
        (bridge_trigger_id(RowRef.of(3, T0)), "fast")
    ]
    assert stops[0].cancel is not None
    assert stops[0].cancel.task.task_id == "t3"
    assert len(book) == 1


def test_a_watch_airflow_deleted_is_tombstoned_whatever_its_events() -> None:
    book = RowBook()
    for row_id in (1, 2):
        ref = RowRef.of(row_id, T0)
        book.handed(ref, WatchRequest(trigger_id=bridge_trigger_id(ref), classpath="x.Watch"))
    book.applied([RowRef.of(1, T0)])  # its events do not end it
    stops = book.settle({1, 2}, deleted={1})  # row 2 went to another triggerer
    assert [(s.trigger_id, s.cancel) for s in stops] == [
        (bridge_trigger_id(RowRef.of(1, T0)), None)
    ]


def test_an_event_of_an_older_row_under_the_same_id_does_not_count() -> None:
    book = RowBook()
    handed(book, 1)
    book.applied([RowRef.of(1, T0 - dt.timedelta(seconds=1))])
    cancels = book.settle({1}, deleted={1})
    assert len(cancels) == 1
