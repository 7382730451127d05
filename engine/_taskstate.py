"""The task state machine and event dedup: a pure fold of the tasks and resume topics.

One :class:`TaskTable` holds the state of every task instance, keyed by ``TaskKey.ti_key``. It
folds two streams: :class:`TaskStateRecord` values from the tasks topic (written by clients,
workers and the scheduler itself) and :class:`TriggerEventRecord` values from the resume
topics. It does no I/O and reads no clock: every time it writes comes from a record, so the
same input in the same order gives the same state and the same output, byte for byte.

Rules (Airflow's, with deferline's pool handling):

- Records of one task are ordered by *progress* (try number, then deferral, then step); a
  record behind the current one is stale and never moves the state back. When a stale record
  is the last one written to the compacted tasks topic, :meth:`TaskTable.drain` re-publishes
  the current state so the topic converges ("repair").
- An event applies only while its task is ``deferred`` on that trigger (same trigger id, try
  number and defer sequence). An event for a deferral not seen yet is held pending; anything
  else is a duplicate or stale event: counted, never applied.
- ``fired`` → ``queued`` with the deferral's ``next_method``/``next_kwargs`` and the event, plus
  a resume RunTask; ``failed``/``timed_out`` → resume into ``__fail__``; an event with
  ``task_outcome`` ends the task without a worker; ``cancelled`` → ``removed``.
- Pools with slot counts admit new work in priority-weight order. ``queued``, ``running`` and
  ``deferred`` tasks hold their slots; a resume keeps the slot and bypasses the pool. With
  :class:`LedgerAdmission` (several schedulers, each owning some task partitions), limited
  pools admit through the pool ledger instead: the table publishes wants and starts a task
  when it reads its grant (see :mod:`._pool_claims`); unlimited pools still admit at once.
- ``up_for_retry`` schedules the next try; a task cleared (``removed``) while deferred gets a
  CancelRequest for its trigger.

Decisions that depend on the whole table (admission, retries, cancels, repairs) are taken in
:meth:`TaskTable.drain`, so a process rebuilding its state from the topics can fold everything
first and decide once, instead of re-deciding what the topics already record.
"""

from __future__ import annotations

import datetime as dt
import heapq
import logging
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any

from deferline.schemas import (
    CancelRequest,
    EventFields,
    ResumeTarget,
    TaskStateRecord,
    TriggerEventRecord,
    decode,
)

from ._pool_claims import LedgerAdmission, PoolClaims
from ._pool_ledger import PoolEntry
from ._task_pools import PoolBook, Pools, _holds, start_records
from ._taskstate_census import Census
from ._taskstate_checkpoint import FORMAT, TableDelta, read_rows
from ._taskstate_values import (
    _EPOCH,
    _FINISHED,
    Emit,
    TableCounters,
    Verdict,
    _Pending,
    _resume_run,
    _ResumeRun,
    _Slim,
    _View,
    progress,
    resumed_state,
)

__all__ = ["TaskTable"]

logger = logging.getLogger(__name__)


class TaskTable:
    """State of every task instance, folded from the tasks and resume topics. No I/O.

    Feed records with :meth:`apply`; collect what to publish with :meth:`drain`. With
    ``ledger``, tasks of limited pools are admitted through the pool ledger: feed the pools
    topic's records of this table's tasks with :meth:`apply_pool`, and publish the wants
    :meth:`take_pool_writes` hands out after each drain.
    """

    def __init__(
        self, *, pools: Pools | None = None, ledger: LedgerAdmission | None = None
    ) -> None:
        self._pools = PoolBook(pools if pools is not None else Pools())
        self._claims = PoolClaims(self._pools.pools, ledger) if ledger is not None else None
        self.counters = TableCounters()
        self._views: dict[str, _View] = {}
        self._pending: dict[str, list[_Pending]] = {}
        self._pending_count = 0
        self._generation = 0
        self._outbox: list[Emit] = []
        self._retry: set[str] = set()
        self._cancel: dict[str, tuple[Emit, TaskStateRecord]] = {}  # cancel, the removal
        self._repair: set[str] = set()
        self._finished: deque[tuple[dt.datetime, str]] = deque()  # (finished at, key)
        self._targets: dict[tuple[str, str, str, int, int, int], ResumeTarget] = {}
        self._clock = _EPOCH
        self._changed: set[str] | None = None  # keys moved since the last checkpoint
        self._census = Census(self._record)

    # -- reading ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._views)

    def __contains__(self, ti_key: object) -> bool:
        return ti_key in self._views

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def get(self, ti_key: str) -> TaskStateRecord | None:
        """The current state record of a task instance, or None if unknown."""
        view = self._views.get(ti_key)
        return view.record.full() if view is not None else None

    def snapshot(self) -> dict[str, TaskStateRecord]:
        """Current state record of every task instance."""
        return {key: view.record.full() for key, view in self._views.items()}

    def count_by_state(self) -> dict[str, int]:
        """How many task instances are in each state (kept as the table changes)."""
        return self._census.counts()

    def overdue_deferrals(self, now: dt.datetime) -> int:
        """Deferred task instances whose deferral timed out before ``now`` and still wait
        (their triggerer should have emitted ``timed_out``); without walking the table."""
        return self._census.overdue(now)

    @property
    def pools(self) -> Pools:
        """The pools' slot counts this table admits by."""
        return self._pools.pools

    def pool_usage(self) -> dict[str, tuple[int, int | None]]:
        """Slots in use and pool size, per pool that has been used or configured (with a
        ledger: the slots this table's tasks hold; the ledger has the global figure)."""
        return self._pools.usage()

    @property
    def ledger(self) -> LedgerAdmission | None:
        """How limited pools admit through the pool ledger; None: admitted in this table."""
        return self._claims.admission if self._claims is not None else None

    @property
    def pool_claims(self) -> PoolClaims | None:
        """The wants and grants of this table's tasks (ledger admission only)."""
        return self._claims

    @property
    def pending_events(self) -> int:
        """Events held until their deferral is seen."""
        return self._pending_count

    def pending_refs(self) -> Iterator[Hashable]:
        """The ``ref`` of every pending event (the runner's topic position of each)."""
        for items in self._pending.values():
            for item in items:
                if item.ref is not None:
                    yield item.ref

    @property
    def clock(self) -> dt.datetime:
        """The latest time read from any record: the table's only notion of now."""
        return self._clock

    # -- folding ---------------------------------------------------------------------------

    def apply(
        self,
        record: TaskStateRecord | TriggerEventRecord | EventFields | _Slim,
        *,
        ref: Hashable | None = None,
        resend: bool = False,
    ) -> Verdict:
        """Fold one record. ``ref`` is kept with a pending event (see :meth:`pending_refs`).

        An event may come as its model or as :class:`~deferline.schemas.EventFields`; a task
        state as its model or as :attr:`Emit.written` (a state this table decided, read back).

        ``resend``: the event is read again by a scheduler that took over without
        transactions, and its predecessor may have died after writing the task's ``queued``
        state but before its RunTask. If the task is still ``queued`` on exactly this event,
        the RunTask is published again (the same record); workers ignore a RunTask the task
        has moved past, so a copy that was in fact sent costs one ignored message.
        """
        if isinstance(record, EventFields):
            self._tick(record.emitted_at)
            return self._apply_event(record, ref, resend=resend)
        if isinstance(record, TriggerEventRecord):
            self._tick(record.emitted_at)
            return self._apply_event(EventFields.of(record), ref, resend=resend)
        self._tick(record.updated_at)
        if isinstance(record, _Slim):
            key = record.ti_key
            view = self._views.get(key)
            if view is not None:
                inflight = view.inflight
                # One of this table's writes read back, usually the oldest on its way and
                # still the task's state, with no cancel of it waiting: then it only lands.
                if (
                    inflight
                    and inflight[0] is record
                    and view.record is record
                    and key not in self._cancel
                ):
                    view.inflight = inflight[1:]
                    view.needs_repair = False
                    return "echo"
                if any(own is record for own in inflight):
                    return self._apply_state(record, key)
            record = record.full()  # not a write this table waits for: fold it as any
        return self._apply_state(record)

    def apply_pool(self, entry: PoolEntry) -> None:
        """Fold a pools-topic record (want or grant) of one of this table's tasks; a grant
        for a task still ``scheduled`` on that attempt starts it at the next :meth:`drain`."""
        if self._claims is None:
            raise ValueError("this table admits locally: it has no pool ledger to read")
        self._claims.read(entry)

    def take_pool_writes(self) -> list[PoolEntry]:
        """The wants and want tombstones :meth:`drain` decided, to publish on the pools
        topic in this order, in the same transaction as the drain's records."""
        if self._claims is None:
            return []
        out, self._claims.outbox = self._claims.outbox, []
        return out

    def forget(self, ti_key: str) -> None:
        """Drop a task instance (its key was tombstoned on the tasks topic); frees its slot."""
        if self._claims is not None:
            self._claims.dirty.add(ti_key)
        view = self._views.pop(ti_key, None)
        if view is not None:
            self._census.moved(ti_key, view.record, None)
        if view is not None and view.holds is not None:
            self._pools.hold(view.holds, None)
        if view is not None and self._changed is not None:
            self._changed.add(ti_key)
        self._retry.discard(ti_key)
        self._cancel.pop(ti_key, None)
        self._repair.discard(ti_key)

    def drop_where(self, belongs: Callable[[str], bool]) -> int:
        """Drop every task whose key ``belongs`` (its partition went to another scheduler),
        with its slots, pending events and queued decisions; returns how many tasks.

        Unlike :meth:`forget` the keys do not count as changed: the partition's checkpoint
        is no longer this table's to write. Call with nothing drained and unpublished.
        """
        keys = [key for key in {*self._views, *self._pending} if belongs(key)]
        dropped = 0
        for key in keys:
            view = self._views.pop(key, None)
            if view is not None:
                dropped += 1
                self._census.moved(key, view.record, None)
                if view.holds is not None:
                    self._pools.hold(view.holds, None)
            items = self._pending.pop(key, None)
            if items:
                self._pending_count -= len(items)
            self._retry.discard(key)
            self._cancel.pop(key, None)
            self._repair.discard(key)
            if self._changed is not None:
                self._changed.discard(key)
        if self._claims is not None:
            self._claims.drop_where(belongs)
        return dropped

    def absorb(self, other: TaskTable) -> int:
        """Take every task of ``other``, a table of keys this one does not hold (a partition
        folded on its own), with slots, waiting places and queued decisions; ``other`` must
        hold no pending events, and is left empty. Its keys count as changed as they did
        there (all of them if it tracked no changes). Returns how many tasks were taken.

        The work is in C or per decision, not per task in Python: a restart absorbs every
        partition, a million tasks, into an empty table (docs/benchmarks.md). With a pool
        ledger, the keys ``other`` has still to settle are settled at the next drain, against
        the pools records read for them by then; a task of an unlimited pool needs settling
        only for a want read for it, and reading one marks it (:meth:`apply_pool`).
        """
        if other._pending:
            raise ValueError("absorb a table without pending events only")
        theirs = other._views
        clash = theirs.keys() & self._views.keys()
        if clash:
            raise ValueError(f"absorb a table of other keys only ({len(clash)} shared)")
        if self._views:
            self._views.update(theirs)
        else:
            self._views = theirs
        self._pools.merge(other._pools)
        self._census.merge(other._census)
        for target_key, target in other._targets.items():
            self._targets.setdefault(target_key, target)
        if other._finished:
            if self._finished:
                self._finished = deque(heapq.merge(self._finished, other._finished))
            else:
                self._finished = other._finished
        self._retry |= other._retry
        self._cancel.update(other._cancel)
        self._repair |= other._repair
        self._outbox += other._outbox
        self._clock = max(self._clock, other._clock)
        if self._claims is not None:
            self._claims.dirty |= self._unsettled(other)
        if self._changed is not None:
            changed = other._changed if other._changed is not None else set(theirs)
            if self._changed:
                self._changed |= changed
            else:
                self._changed = changed
        other._views, other._outbox, other._finished = {}, [], deque()
        other._retry, other._cancel, other._repair = set(), {}, set()
        if other._changed is not None:
            other._changed = set()
        return len(theirs)

    def _unsettled(self, other: TaskTable) -> set[str]:
        """The keys of ``other`` this table's pool claims must settle once absorbed."""
        claims = self._claims
        assert claims is not None
        dirty: set[str] = set()
        if other._claims is not None:
            dirty, other._claims.dirty = other._claims.dirty, set()
            if other._claims.pools is claims.pools:
                return dirty  # its tasks of limited pools were marked as they were folded
        return dirty | {
            key
            for key, view in other._views.items()
            if view.target is not None and claims.limited(view.target.pool)
        }

    def forget_finished(self, retention: float) -> int:
        """Drop tasks that finished more than ``retention`` seconds (by record time) before
        :attr:`clock`; the tasks topic still holds them. Returns how many were dropped."""
        cutoff = self._clock - dt.timedelta(seconds=retention)
        dropped = 0
        while self._finished and self._finished[0][0] <= cutoff:
            _, key = self._finished.popleft()
            view = self._views.get(key)
            if (
                view is not None
                and view.record.state in _FINISHED
                and view.record.updated_at <= cutoff
                and not view.inflight
                and key not in self._cancel
                and key not in self._repair
                and key not in self._pending
            ):
                self.forget(key)
                dropped += 1
        return dropped

    def mark_generation(self) -> int:
        """Close the current generation of pending events and return its number.

        A runner calls this, then reads the tasks topic's end offsets; once its tasks consumer
        reaches them, every deferral written before those events is folded, so events of
        generations up to the returned one that are still pending can never apply:
        :meth:`expire_pending` drops them as orphans.
        """
        closed = self._generation
        self._generation += 1
        return closed

    def expire_pending(self, upto: int) -> list[tuple[EventFields, Hashable | None]]:
        """Take pending events of generations ``<= upto`` out as orphans: (event, ref) each,
        for the runner to dead-letter."""
        orphans: list[tuple[EventFields, Hashable | None]] = []
        for key in list(self._pending):
            keep = [item for item in self._pending[key] if item.generation > upto]
            orphans += [(i.event, i.ref) for i in self._pending[key] if i.generation <= upto]
            if keep:
                self._pending[key] = keep
            else:
                del self._pending[key]
        self._pending_count -= len(orphans)
        self.counters.events_orphaned += len(orphans)
        return orphans

    def drain(self) -> list[Emit]:
        """Take the decisions the current state calls for and return everything to publish.

        Order matters and is kept: for one task, its TaskStateRecord comes before its RunTask.
        """
        for key in sorted(self._retry):
            self._schedule_retry(key)
        self._retry.clear()
        for key in sorted(self._cancel):
            self._send_cancel(key, *self._cancel[key])
        self._cancel.clear()
        for key in sorted(self._repair):
            view = self._views[key]
            if view.needs_repair and not view.inflight:
                current = view.record.full()
                self._outbox.append(Emit(current))
                view.inflight += (current,)
                view.needs_repair = False
                self.counters.repairs += 1
        self._repair.clear()
        if self._claims is not None:
            self._settle_claims(self._claims)
        for pool in self._pools.waiting():
            for key, view in self._pools.admissible(pool, self._views):
                assert view.target is not None  # admissible tasks have one
                state, run = start_records(view.record, view.target, self._clock)
                self._own(key, view, state)
                self._outbox.append(Emit(run))
                self.counters.starts += 1
        out, self._outbox = self._outbox, []
        return out

    # -- checkpoints (see _taskstate_checkpoint) -------------------------------------------

    @property
    def unpublished(self) -> bool:
        """True while the table holds decisions that :meth:`drain` (or
        :meth:`take_pool_writes`) has not handed out."""
        return bool(self._outbox) or (self._claims is not None and bool(self._claims.outbox))

    def track_changes(self) -> None:
        """Note from now on which keys change; every key known so far counts as changed."""
        self._changed = set(self._views)

    def mark_changed(self, keys: Iterable[str]) -> None:
        """Count ``keys`` as changed again (an export of them was not stored)."""
        if self._changed is not None:
            self._changed.update(keys)

    def export_changes(self) -> TableDelta:
        """The views changed or forgotten since the last export, and the table-wide state.

        Call at a point where the table is the fold of the positions being saved (plus own
        writes the broker acknowledged), with nothing decided and not yet published.
        """
        changed, self._changed = self._changed or set(), set()
        views = self._views
        upserts = []
        deletes = []
        for key in changed:
            view = views.get(key)
            if view is None:
                deletes.append(key)
            else:
                upserts.append((key, view.record, view.at, view.target))
        repair = sorted(key for key in self._repair if views[key].needs_repair)
        cancels = [
            (key, cancel.record, cancel.queue, removal)
            for key, (cancel, removal) in sorted(self._cancel.items())
            if isinstance(cancel.record, CancelRequest)
        ]
        return TableDelta(upserts, deletes, repair, cancels, self._clock)

    def restore_rows(
        self, rows: Iterable[tuple[bytes, bytes]], state: Mapping[str, Any], *, skip: int = 0
    ) -> int:
        """Fill an empty table from exported rows and state; returns how many tasks. ``skip``:
        bytes to skip at the start of each row's key (a store's own prefix).

        Raises ValueError on rows of another format or that do not decode.
        """
        if self._views:
            raise ValueError("restore into an empty table only")
        if state.get("format") != FORMAT:
            raise ValueError(f"checkpoint format {state.get('format')!r}, expected {FORMAT}")
        restored = read_rows(rows, self._shared, skip)
        views = self._views = restored.views
        ready = restored.ready
        claims = self._claims
        if claims is not None:  # limited pools admit through the ledger: settle them anew
            ready = {pool: queue for pool, queue in ready.items() if not claims.limited(pool)}
            limited = {
                id(target)
                for target in {id(view.target): view.target for view in views.values()}.values()
                if target is not None and claims.limited(target.pool)
            }
            if limited:
                claims.dirty.update(
                    key
                    for key, view in views.items()
                    if id(view.target) in limited
                    and (view.holds is not None or view.record.state == "scheduled")
                )
        self._pools.restore(restored.used, ready)
        self._census = Census(self._record, restored.counts, restored.deadlines)
        self._finished = deque(restored.finished)
        self._retry = restored.retry
        self._clock = dt.datetime.fromisoformat(state["clock"])
        for key in state.get("repair", ()):
            if key in views:
                views[key].needs_repair = True
                self._repair.add(key)
        for key, cancel, queue, removal in state.get("cancels", ()):
            request, record = decode(cancel.encode()), decode(removal.encode())
            if isinstance(request, CancelRequest) and isinstance(record, TaskStateRecord):
                self._cancel[key] = (Emit(request, queue=queue), record)
        if self._changed is not None:
            self._changed = set()
        return len(views)

    # -- internals -------------------------------------------------------------------------

    def _tick(self, when: dt.datetime) -> None:
        if when > self._clock:
            self._clock = when

    def _apply_state(self, record: TaskStateRecord | _Slim, key: str | None = None) -> Verdict:
        """Fold a task state (a :class:`_Slim` only when it is one of ``inflight``);
        ``key``: its ``ti_key``, when the caller has it."""
        if key is None:
            key = record.ti_key if isinstance(record, _Slim) else record.task.ti_key
        at = progress(record)
        view = self._views.get(key)
        if view is None:
            assert isinstance(record, TaskStateRecord)
            target = self._shared(record.resume)
            view = _View(record=_Slim(record, target), at=at, target=target)
            self._views[key] = view
            self._entered(key, view, None)
            self.counters.states_applied += 1
            return "applied"
        sent = self._cancel.get(key)
        if (
            sent is not None
            and record.state == "removed"
            and record.source == "scheduler"
            and sent[0].record.trigger_id == record.trigger_id
        ):
            del self._cancel[key]  # rebuilding: this trigger's cancel already went out
        if record in view.inflight:
            # One of our own writes read back; it may already be behind the current state.
            view.inflight = view.inflight[view.inflight.index(record) + 1 :]
            if at == view.at:
                view.needs_repair = False
                return "echo"
            if view.inflight:
                return "echo"  # a later write of ours is still on its way
        elif at == view.at and record.state == view.record.state:
            view.needs_repair = False
            return "echo"
        if at <= view.at:
            # Behind the current state. If it is the last record the tasks topic holds for
            # this task (none of our writes still on its way), publish the state again.
            if not view.inflight:
                view.needs_repair = True
                self._repair.add(key)
            self.counters.states_stale += 1
            logger.debug(
                "stale task state ignored",
                extra={
                    "task": str(record.task),
                    "state": record.state,
                    "current": view.record.state,
                },
            )
            return "stale"
        self._advance(key, view, record)
        view.needs_repair = False
        self.counters.states_applied += 1
        return "applied"

    def _advance(self, key: str, view: _View, record: TaskStateRecord | _Slim) -> None:
        previous = view.record
        if isinstance(record, _Slim):  # decided by this table: its target is the view's
            view.record = record
        else:
            if record.resume is not None:
                view.target = self._shared(record.resume)
            view.record = _Slim(record, view.target if record.resume is not None else None)
        view.at = progress(record)
        self._entered(key, view, previous)

    def _record(self, key: str) -> _Slim | None:
        view = self._views.get(key)
        return None if view is None else view.record

    def _shared(self, target: ResumeTarget | None) -> ResumeTarget | None:
        """One object per distinct resume target (without op_kwargs), not one per task."""
        if target is None or target.op_kwargs:
            return target
        key = (
            target.operator,
            target.worker_queue,
            target.pool,
            target.pool_slots,
            target.priority_weight,
            target.retries,
        )
        return self._targets.setdefault(key, target)

    def _entered(self, key: str, view: _View, previous: _Slim | None) -> None:
        """Book-keeping after ``view.record`` changed: pool slots, queues, follow-ups."""
        record = view.record
        self._census.moved(key, previous, record)
        if self._changed is not None:
            self._changed.add(key)
        if record.state in _FINISHED:
            self._finished.append((record.updated_at, key))
        holds = _holds(record, view.target)
        if holds != view.holds:
            self._pools.hold(view.holds, holds)
            view.holds = holds
        claims = self._claims
        if claims is not None and (
            (view.target is not None and claims.limited(view.target.pool))
            or claims.want(key) is not None
        ):
            claims.dirty.add(key)  # a want to publish or tombstone, a grant to use: in drain
        if (
            record.state == "scheduled"
            and record.next_method is None
            and view.target is not None
            and (claims is None or not claims.limited(view.target.pool))
        ):
            entry = (-view.target.priority_weight, record.updated_at, key, record.try_number)
            self._pools.wait(view.target.pool, entry)
        if record.state == "up_for_retry":
            self._retry.add(key)
        elif (
            record.state == "removed"
            and record.source != "scheduler"
            and previous is not None
            and previous.state == "deferred"
            and previous.trigger_id is not None
        ):
            cancel = CancelRequest(
                trigger_id=previous.trigger_id,
                task=previous.task,
                defer_seq=previous.defer_seq,
                reason=record.reason or "cleared",
                requested_at=record.updated_at,
            )
            self._cancel[key] = (Emit(cancel, queue=previous.queue), record.full())
            view.resolve(previous.trigger_id)
        if key in self._pending:
            self._resolve_pending(key)

    def _resolve_pending(self, key: str) -> None:
        items = self._pending.pop(key)
        self._pending_count -= len(items)
        # Each item sees the state the previous one left; hold=False never re-adds an item.
        keep = [
            item
            for item in items
            if self._apply_event(item.event, item.ref, hold=False) == "pending"
        ]
        if keep:
            self._pending.setdefault(key, []).extend(keep)
            self._pending_count += len(keep)

    def _apply_event(
        self,
        event: EventFields,
        ref: Hashable | None,
        *,
        hold: bool = True,
        resend: bool = False,
    ) -> Verdict:
        key = event.task.ti_key
        view = self._views.get(key)
        wanted = (event.task.try_number, event.defer_seq + 1, 0)
        if (
            view is not None
            and view.record.state == "deferred"
            and view.at == wanted
            and view.record.trigger_id == event.trigger_id
        ):
            self._resume(key, view, event)
            return "applied"
        if view is None or view.at < wanted:
            if hold:
                self._pending.setdefault(key, []).append(
                    _Pending(event=event, generation=self._generation, ref=ref)
                )
                self._pending_count += 1
            return "pending"
        if event.resumed_directly and event.trigger_id not in view.resolved:
            view.resolve(event.trigger_id)
            self.counters.events_direct += 1
            return "direct"
        if event.status == "cancelled":
            self.counters.events_cancelled += 1
            return "cancelled"
        if resend and self._resend(view, event):
            return "resent"
        self.counters.events_duplicate += 1
        logger.info(
            "duplicate or stale trigger event dropped",
            extra={
                "trigger_id": event.trigger_id,
                "task": str(event.task),
                "event_id": event.event_id,
                "partition": event.partition,
                "member": event.member,
                "state": view.record.state,
            },
        )
        return "duplicate"

    def _resume(self, key: str, view: _View, event: EventFields) -> None:
        self.counters.events_applied += 1
        view.resolve(event.trigger_id)
        if logger.isEnabledFor(logging.DEBUG):  # the extra costs more than the fold itself
            logger.debug(
                "trigger event applied",
                extra={
                    "trigger_id": event.trigger_id,
                    "task": str(event.task),
                    "status": event.status,
                    "partition": event.partition,
                    "member": event.member,
                },
            )
        target = view.target
        state = resumed_state(view.record, target, event)
        self._own(key, view, state)
        if event.status == "fired" and event.task_outcome is not None:
            self.counters.ended_by_trigger += 1
        elif state.state == "queued" and target is not None and not event.resumed_directly:
            self._outbox.append(Emit(_ResumeRun(state, target, event), key=key))
            self.counters.resumes += 1

    def _resend(self, view: _View, event: EventFields) -> bool:
        """Publish again the RunTask of a task ``queued`` on exactly ``event`` (see apply)."""
        record, target = view.record, view.target
        if (
            record.state != "queued"
            or target is None
            or event.resumed_directly
            or record.event_id != event.event_id
            or record.trigger_id != event.trigger_id
            or record.defer_seq != event.defer_seq
            or record.try_number != event.task.try_number
            or record.next_method is None
        ):
            return False
        self._outbox.append(Emit(_resume_run(record, target, event)))
        self.counters.resends += 1
        logger.info(
            "RunTask re-sent for a task queued on a re-read event",
            extra={"task": str(record.task), "trigger_id": event.trigger_id},
        )
        return True

    def _own(self, key: str, view: _View, record: TaskStateRecord | _Slim) -> None:
        """Move to a state the table itself decided, and publish it."""
        self._outbox.append(Emit(record, key=key))
        self._advance(key, view, record)
        view.inflight += (record,)
        view.needs_repair = False

    def _send_cancel(self, key: str, cancel: Emit, removal: TaskStateRecord) -> None:
        """Publish the CancelRequest, then a "removed" record naming the cancelled trigger.

        The record is the proof the cancel went out: a scheduler rebuilding its state from the
        topics finds it and does not cancel the same trigger again.
        """
        view = self._views[key]
        request = cancel.record
        assert isinstance(request, CancelRequest)
        marker = removal.model_copy(
            update={
                "source": "scheduler",
                "trigger_id": request.trigger_id,
                "defer_seq": request.defer_seq,
                "queue": cancel.queue,
                "reason": f"{request.reason} (trigger cancelled)",
            }
        )
        self._outbox.append(cancel)
        self._outbox.append(Emit(marker))
        view.inflight += (marker,)
        self.counters.cancels += 1

    def _settle_claims(self, claims: PoolClaims) -> None:
        """Publish the wants the tasks call for; start the granted ones (as local admission
        would: their ``queued`` state and RunTask)."""
        keys = sorted(claims.dirty)
        claims.dirty.clear()
        for key in keys:
            view = self._views.get(key)
            if claims.settle(key, view):
                assert view is not None
                assert view.target is not None
                state, run = start_records(view.record, view.target, self._clock)
                self._own(key, view, state)
                self._outbox.append(Emit(run))
                self.counters.starts += 1

    def _schedule_retry(self, key: str) -> None:
        view = self._views[key]
        record = view.record
        if record.state != "up_for_retry" or view.target is None:
            return
        task = record.task.model_copy(update={"try_number": record.task.try_number + 1})
        state = TaskStateRecord(
            task=task,
            state="scheduled",
            reason="retry",
            updated_at=record.updated_at,
            source="scheduler",
            resume=view.target,
        )
        self.counters.retries += 1
        self._own(key, view, state)
