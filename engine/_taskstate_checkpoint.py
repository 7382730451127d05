"""Checkpoints of a :class:`~deferline.engine.TaskTable`: what changed, and a fast restore.

A scheduler restarted over a million tasks should not decode a million pydantic records
to rebuild its fold (docs/benchmarks.md has both costs). The table therefore exports each
task's view as a compact row (three orjson lists on lines of their own: a head of the state,
progress and times, the resume target, and the rest of the slim record's fields) and restores
a whole table from rows without validating them again: the rows were made from validated
records. A restore reads the heads and targets; a task's rest is decoded when the task is
first read (most restored tasks wait for an event that comes much later). Only what changed
since the last export is exported: the table notes the keys whose view moved or that were
forgotten (see ``track_changes``).

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
    encode,
    from_tagged,
    to_tagged,
)

from ._taskstate_values import _FINISHED, HOLDING_STATES, Progress, _Slim, _View

__all__ = ["TableDelta", "TableRows"]

FORMAT = 2
"""Version of the row layout; a checkpoint of another version is not restored (2: a head
decoded at restore, the rest when the task is first read)."""

_TAG = b'"__type"'
"""Present in a row only if one of its values is tagged (plain JSON decodes as itself)."""


@contextlib.contextmanager
def _collector_paused(*, settle: bool = False) -> Iterator[None]:
    """Millions of objects made in a row, none in a cycle: without this the cyclic collector
    rescans the whole (large) heap again and again (its cost is in docs/benchmarks.md).

    With ``settle``, what was made is moved to the oldest generation at the end, as if it had
    survived the younger collections (``gc.freeze`` then ``gc.unfreeze``): a restored table
    lives as long as its process, and the first collections after a restore would otherwise
    walk every object it made, twice (a tenth of a restore's time). Objects made meanwhile
    elsewhere are moved too; a cycle among them waits for the next full collection.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if settle:
            gc.freeze()
            gc.unfreeze()
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


def encode_row(record: _Slim, at: Progress, target: bytes) -> bytes:
    """One task's view as a compact row: a head of what a restore needs at once, the resume
    target (``target``: its JSON, see :func:`target_json`), and the rest of the record, which
    a restore decodes only when the task is first read (see :class:`_Stored`); a newline
    between each. A restored record never read since is written as it was read."""
    if type(record) is _Stored and record.raw is not None:
        return record.raw
    head = orjson.dumps(
        (record.state, at, record.updated_at, record.timeout_at, record.resume is not None)
    )
    rest = orjson.dumps(
        (
            record.dag_id,
            record.task_id,
            record.run_id,
            record.map_index,
            record.try_number,
            record.trigger_id,
            record.defer_seq,
            record.next_method,
            _tagged(record.next_kwargs),
            _tagged(record.event),
            record.event_id,
            record.reason,
            record.source,
            record.queue,
            _tagged(record.xcoms),
        )
    )
    return b"\n".join((head, target, rest))  # of its own size (see dumps_kept)


def target_json(target: ResumeTarget | None) -> bytes:
    """A resume target's part of a row."""
    return orjson.dumps(_target_row(target))


class _Stored(_Slim):
    """A task record restored from a row, its fields decoded when one is first read.

    A restart restores every task of its partitions, most of them deferred and not read again
    until their event comes: decoding only what the table's indexes need (state, progress,
    target, and the time a finished task ended or a deferral times out) makes a restore
    faster and smaller (docs/benchmarks.md). Python looks a slot up through
    :meth:`__getattr__` only while it is unset, so a decoded record costs nothing more to read.
    The fields, once decoded, are those of the record the row was made from; like every
    :class:`_Slim` it never changes.
    """

    __slots__ = ("raw",)

    raw: bytes | None
    """The row, until the record is decoded."""

    def __getattr__(self, name: str) -> Any:
        raw = self.raw
        if raw is None or name not in _FIELDS:
            raise AttributeError(name)
        _decode(self, raw)
        return object.__getattribute__(self, name)


_FIELDS = frozenset(_Slim.__slots__)


def _decode(record: _Stored, raw: bytes) -> None:
    """Set every field of ``record`` from its row (ValueError if the row does not decode)."""
    try:
        head, _, rest = raw.split(b"\n", 2)
        _, _, updated_at, timeout_at, _ = orjson.loads(head)
        (
            dag_id,
            task_id,
            run_id,
            map_index,
            try_number,
            trigger_id,
            defer_seq,
            next_method,
            next_kwargs,
            event,
            event_id,
            reason,
            source,
            queue,
            xcoms,
        ) = orjson.loads(rest)
        if _TAG in rest:  # some value carries a type JSON lacks: decode the tags
            next_kwargs, event, xcoms = _untagged(next_kwargs), _untagged(event), _untagged(xcoms)
    except (ValueError, TypeError, SchemaError) as exc:
        raise ValueError(f"checkpoint row does not decode: {exc}") from exc
    intern = sys.intern
    record.dag_id = intern(dag_id)
    record.task_id = intern(task_id)
    record.run_id = run_id
    record.map_index = map_index
    record.try_number = try_number
    record.trigger_id = trigger_id
    record.defer_seq = defer_seq
    record.next_method = None if next_method is None else intern(next_method)
    record.next_kwargs = next_kwargs
    record.event = event
    record.event_id = event_id
    record.reason = reason
    record.updated_at = dt.datetime.fromisoformat(updated_at)
    record.source = source
    record.timeout_at = _when(timeout_at)
    record.queue = queue
    record.xcoms = xcoms
    record.raw = None


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
        targets: dict[int, bytes] = {}  # by identity: most tasks share a target object
        rows = []
        for key, record, at, target in self.upserts:
            target_row = targets.get(id(target))
            if target_row is None:
                target_row = targets[id(target)] = target_json(target)
            rows.append((key.encode(), encode_row(record, at, target_row)))
        return TableRows(
            rows=rows,
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
    counts: dict[str, int]
    """Tasks per state."""
    deadlines: list[tuple[dt.datetime, str]]
    """(timeout, key) of every deferral with a timeout."""


def read_rows(
    rows: Iterable[tuple[bytes, bytes]],
    shared: Callable[[ResumeTarget], ResumeTarget | None],
    skip: int = 0,
) -> RestoredViews:
    """Rebuild the views of a table from exported rows, and what derives from them.

    ``shared`` gives the one object a table keeps per distinct resume target; ``skip``: how
    many bytes of each key to skip (a store's prefix). Raises ValueError on rows that do not
    decode.
    """
    with _collector_paused(settle=True):
        return _read_rows(rows, shared, skip)


def _read_rows(
    rows: Iterable[tuple[bytes, bytes]],
    shared: Callable[[ResumeTarget], ResumeTarget | None],
    skip: int,
) -> RestoredViews:
    views: dict[str, _View] = {}
    retry: set[str] = set()
    used: dict[str, int] = {}
    targets: dict[bytes, ResumeTarget | None] = {b"null": None}  # shared, by their row
    ready: dict[str, list[tuple[int, dt.datetime, str, int]]] = {}
    finished: list[tuple[dt.datetime, str]] = []
    counts: dict[str, int] = {}
    deadlines: list[tuple[dt.datetime, str]] = []
    fromiso = dt.datetime.fromisoformat
    new = object.__new__
    loads, view_of, stored, holding = orjson.loads, _View, _Stored, HOLDING_STATES
    # Most tasks share their target with many others: the last shared target's line (with
    # its newline) is compared in place, without a slice or a lookup.
    last_line, last_target = b"null\n", None
    try:
        for raw_key, raw in rows:
            key = raw_key[skip:].decode()
            cut = raw.index(b"\n")
            state_name, at, updated_at, timeout_at, has_resume = loads(raw[:cut])
            if raw.startswith(last_line, cut + 1):
                target = last_target
            else:
                target_row = raw[cut + 1 : raw.index(b"\n", cut + 1)]
                if target_row in targets:
                    target = targets[target_row]
                    last_line, last_target = target_row + b"\n", target
                else:
                    row = loads(target_row)
                    target = _target_of(row)
                    if len(row) == 6:  # no op_kwargs: one object per distinct target
                        target = targets[target_row] = shared(target)
                        last_line, last_target = target_row + b"\n", target
            record: _Stored = new(stored)
            record.raw = raw
            record.state = state_name
            record.resume = target if has_resume else None
            view = view_of(record, (at[0], at[1], at[2]), target)
            if target is not None and state_name in holding:
                view.holds = holds = (target.pool, target.pool_slots)
                used[holds[0]] = used.get(holds[0], 0) + holds[1]
            views[key] = view
            counts[state_name] = counts.get(state_name, 0) + 1
            if state_name == "deferred":  # for the overdue count, without decoding
                record.timeout_at = None
                if timeout_at is not None:
                    record.timeout_at = when = fromiso(timeout_at)
                    deadlines.append((when, key))
            elif state_name in _FINISHED:  # for retention, without decoding
                when = record.updated_at = fromiso(updated_at)
                finished.append((when, key))
            elif state_name == "up_for_retry":
                retry.add(key)
            elif state_name == "scheduled":
                _decode(record, raw)
                if record.next_method is None and target is not None:
                    entry = (-target.priority_weight, record.updated_at, key, record.try_number)
                    ready.setdefault(target.pool, []).append(entry)
    except (ValueError, TypeError, SchemaError) as exc:
        raise ValueError(f"checkpoint row does not decode: {exc}") from exc
    finished.sort()
    return RestoredViews(views, used, ready, finished, retry, counts, deadlines)
