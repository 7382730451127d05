"""Checkpoints of a :class:`~deferline.engine.TaskTable`: what changed, and a fast restore.

A scheduler restarted over a million tasks should not decode a million pydantic records
to rebuild its fold (docs/benchmarks.md has both costs). The table therefore exports each
task's view as a compact row (an orjson list of the slim record's fields, its progress and
its resume target) and restores a whole table from rows without validating them again: the
rows were made from validated records. Only what changed since the last export is exported:
the table notes the keys whose view moved or that were forgotten (see ``track_changes``).

What a checkpoint holds is what a fold of the tasks topic up to the checkpoint's positions
holds, plus the table's own writes already acknowledged by the broker (they lie past those
positions and are read back as echoes). Not held: events pending on the resume topics (the
scheduler never commits a resume offset past a pending event, so a restart reads them
again), the own-writes cache of the runner, the trigger ids of events already accounted for
(a fold of the tasks topic does not know them either; they only choose which counter a
repeated event lands in), the counters, and, with ledger admission, the wants and grants of the
pools topic (every scheduler reads that small compacted topic from its beginning at each start,
and must have read it to its end before its first drain; a restored table settles again every
task of a limited pool that is scheduled or holds a slot). Derived structures (pool usage,
the admission queues, retries, finished order) are rebuilt from the views; pending repairs and
cancels, which a view alone cannot tell, are exported whole with every checkpoint (there are
few).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from deferline.schemas import (
    CancelRequest,
    ResumeTarget,
    SchemaError,
    TaskStateRecord,
    dumps_kept,
    encode,
    from_tagged,
    to_tagged,
)

from ._taskstate_values import _FINISHED, HOLDING_STATES, Progress, _Slim, _View

__all__ = ["TableDelta", "TableRows"]

FORMAT = 1
"""Version of the row layout; a checkpoint of another version is not restored."""

_TAG = b'"__type"'
"""Present in a row only if one of its values is tagged (plain JSON decodes as itself)."""


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Millions of objects made in a row, none in a cycle: without this the cyclic collector
    rescans the whole (large) heap again and again (its cost is in docs/benchmarks.md)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _tagged(value: Any) -> Any:
    return None if value is None else to_tagged(value)


def _untagged(value: Any) -> Any:
    return None if value is None else from_tagged(value)


def _when(value: str | None) -> dt.datetime | None:
    return None if value is None else dt.datetime.fromisoformat(value)


def _target_row(target: ResumeTarget | None) -> list[Any] | None:
    if target is None:
        return None
    row: list[Any] = [
        target.operator,
        target.worker_queue,
        target.pool,
        target.pool_slots,
        target.priority_weight,
        target.retries,
    ]
    if target.op_kwargs:
        row.append(to_tagged(target.op_kwargs))
    return row


def _target_of(row: list[Any]) -> ResumeTarget:
    operator, worker_queue, pool, pool_slots, priority_weight, retries, *rest = row
    return ResumeTarget.model_construct(
        operator=operator,
        op_kwargs=from_tagged(rest[0]) if rest else {},
        worker_queue=worker_queue,
        pool=pool,
        pool_slots=pool_slots,
        priority_weight=priority_weight,
        retries=retries,
    )


def encode_row(record: _Slim, at: Progress, target: ResumeTarget | None) -> bytes:
    """One task's view as a compact row (see :func:`restore_rows`)."""
    return dumps_kept(
        (
            record.dag_id,
            record.task_id,
            record.run_id,
            record.map_index,
            record.try_number,
            record.state,
            record.trigger_id,
            record.defer_seq,
            record.next_method,
            _tagged(record.next_kwargs),
            _tagged(record.event),
            record.event_id,
            record.reason,
            record.updated_at,
            record.source,
            record.timeout_at,
            record.queue,
            _tagged(record.xcoms),
            at,
            _target_row(target),
            record.resume is not None,
        )
    )


@dataclass(slots=True)
class TableRows:
    """An export, encoded: rows to write, keys to delete, and the table-wide state.

    ``rows`` and ``deletes`` are keyed by ``ti_key`` (UTF-8); ``state`` is JSON-ready.
    """

    rows: list[tuple[bytes, bytes]]
    deletes: list[bytes]
    state: dict[str, Any]


@dataclass(slots=True)
class TableDelta:
    """What changed in a table since the previous export, captured without encoding.

    Capturing is cheap and must happen at a consistent point (see the module docstring);
    :meth:`encode` may then run in another thread: slim records and targets are never
    changed in place, a view that moves gets new ones.
    """

    upserts: list[tuple[str, _Slim, Progress, ResumeTarget | None]]
    deletes: list[str]
    repair: list[str]
    cancels: list[tuple[str, CancelRequest, str | None, TaskStateRecord]]
    clock: dt.datetime

    @property
    def keys(self) -> set[str]:
        """Every key this delta covers (to mark again if writing it fails)."""
        return {key for key, *_ in self.upserts} | set(self.deletes)

    def encode(self) -> TableRows:
        with _collector_paused():
            return self._encode()

    def _encode(self) -> TableRows:
        return TableRows(
            rows=[
                (key.encode(), encode_row(record, at, target))
                for key, record, at, target in self.upserts
            ],
            deletes=[key.encode() for key in self.deletes],
            state={
                "format": FORMAT,
                "clock": self.clock.isoformat(),
                "repair": self.repair,
                "cancels": [
                    [key, encode(cancel).decode(), queue, encode(removal).decode()]
                    for key, cancel, queue, removal in self.cancels
                ],
            },
        )


@dataclass(slots=True)
class RestoredViews:
    """The views read from a checkpoint's rows, and the structures derived from them."""

    views: dict[str, _View]
    used: dict[str, int]
    """Slots in use per pool."""
    ready: dict[str, list[tuple[int, dt.datetime, str, int]]]
    """Scheduled tasks waiting for a slot, per pool (not yet in heap order)."""
    finished: list[tuple[dt.datetime, str]]
    """(finished at, key) of finished tasks, oldest first."""
    retry: set[str]
    """Tasks up for retry."""


def read_rows(
    rows: Iterable[tuple[bytes, bytes]],
    shared: Callable[[ResumeTarget], ResumeTarget | None],
) -> RestoredViews:
    """Rebuild the views of a table from exported rows, and what derives from them.

    ``shared`` gives the one object a table keeps per distinct resume target. Raises
    ValueError on rows that do not decode.
    """
    with _collector_paused():
        return _read_rows(rows, shared)


def _read_rows(
    rows: Iterable[tuple[bytes, bytes]],
    shared: Callable[[ResumeTarget], ResumeTarget | None],
) -> RestoredViews:
    views: dict[str, _View] = {}
    retry: set[str] = set()
    used: dict[str, int] = {}
    targets: dict[tuple[Any, ...], ResumeTarget | None] = {}
    ready: dict[str, list[tuple[int, dt.datetime, str, int]]] = {}
    finished: list[tuple[dt.datetime, str]] = []
    intern = sys.intern
    fromiso = dt.datetime.fromisoformat
    new = object.__new__
    last_row: list[Any] | None = None
    last_target: ResumeTarget | None = None
    try:
        for raw_key, raw in rows:
            key = raw_key.decode()
            (
                dag_id,
                task_id,
                run_id,
                map_index,
                try_number,
                state_name,
                trigger_id,
                defer_seq,
                next_method,
                next_kwargs,
                event,
                event_id,
                reason,
                updated_at,
                source,
                timeout_at,
                queue,
                xcoms,
                at,
                target_row,
                has_resume,
            ) = orjson.loads(raw)
            if _TAG in raw:  # some value carries a type JSON lacks: decode the tags
                next_kwargs, event, xcoms = (
                    _untagged(next_kwargs),
                    _untagged(event),
                    _untagged(xcoms),
                )
            record: _Slim = new(_Slim)
            record.dag_id = intern(dag_id)
            record.task_id = intern(task_id)
            record.run_id = run_id
            record.map_index = map_index
            record.try_number = try_number
            record.state = state_name
            record.trigger_id = trigger_id
            record.defer_seq = defer_seq
            record.next_method = None if next_method is None else intern(next_method)
            record.next_kwargs = next_kwargs
            record.event = event
            record.event_id = event_id
            record.reason = reason
            record.updated_at = when = fromiso(updated_at)
            record.source = source
            record.timeout_at = _when(timeout_at)
            record.queue = queue
            record.xcoms = xcoms
            target: ResumeTarget | None = None
            if target_row is None:
                pass
            elif target_row == last_row:  # neighbours mostly share their target
                target = last_target
            elif len(target_row) == 6:
                shape = tuple(target_row)
                if shape not in targets:
                    targets[shape] = shared(_target_of(target_row))
                target = last_target = targets[shape]
                last_row = target_row
            else:
                target = _target_of(target_row)
            record.resume = target if has_resume else None
            view = _View(record, (at[0], at[1], at[2]), target)
            if target is not None and state_name in HOLDING_STATES:
                view.holds = holds = (target.pool, target.pool_slots)
                used[holds[0]] = used.get(holds[0], 0) + holds[1]
            views[key] = view
            if state_name in _FINISHED:
                finished.append((when, key))
            elif state_name == "up_for_retry":
                retry.add(key)
            elif state_name == "scheduled" and next_method is None and target is not None:
                entry = (-target.priority_weight, when, key, try_number)
                ready.setdefault(target.pool, []).append(entry)
    except (ValueError, TypeError, SchemaError) as exc:
        raise ValueError(f"checkpoint row does not decode: {exc}") from exc
    finished.sort()
    return RestoredViews(views, used, ready, finished, retry)
