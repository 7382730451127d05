"""A lane's standing watches: triggers that fire many times and never end a task.

A :class:`~deferline.schemas.WatchRequest` on the defer topic stays in the partition's table
until it is tombstoned (by whoever published it). Its trigger runs with no event limit; each
event is published as a :class:`~deferline.schemas.WatchEvent` on the resume topic, numbered
within its run (``<trigger id>:<run>:<seq>``), with no tombstone and no copy on tasks.events.
A run that returns is started again after :data:`RESTART_AFTER_END`, as Airflow's triggerer
starts an asset watcher again at its next loop; a run that fails is started again with
backoff (:func:`restart_delay`), counted in ``deferline_triggerer_watch_runs_total``.

Ownership follows the partition: a run's events are published while its partition emits,
held while it is quiesced (published if it is kept), and dropped (counted) if it is lost;
the new owner starts a run of its own, which reads its source from where the source stands.
The run ids are new at every start, so two runs never share an event id. An event read from
a Kafka record (:class:`~deferline.engine.SourcedEvent`) is named after the record instead
(run ``partition-<n>``, seq its offset + 1): read again after a restart, it is the same event,
and its record's offset is committed with it (:class:`~._emitter.Emitter`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Final

from deferline.engine import BaseTrigger, TriggerOutcome, TriggerSupervisor
from deferline.schemas import (
    WatchEvent,
    WatchRequest,
    make_watch_event_id,
    source_run,
)

from ..member import PartitionPhase
from ._event_sink import EventSink
from ._input import RecordReader, StartWatch
from ._lane_types import OutcomeRoute, OwnedPartition, WatchRef
from ._metrics import TriggererMetrics

logger = logging.getLogger(__name__)

RESTART_AFTER_END: Final = 1.0
"""Seconds between a run that returned and the next (Airflow's triggerer loops once a second)."""
_BACKOFF_FIRST: Final = 1.0
_BACKOFF_MAX: Final = 60.0
_RUNNING_PHASES: Final = frozenset(
    {PartitionPhase.STARTING, PartitionPhase.ACTIVE, PartitionPhase.QUIESCED}
)


def restart_delay(failures: int) -> float:
    """Seconds before the next run after ``failures`` failed runs in a row (1, 2, 4 … 60)."""
    if failures <= 0:
        return RESTART_AFTER_END
    return float(min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** (failures - 1)))


def new_run_id() -> str:
    """A run id: 16 hex digits, new at every start of a watch's trigger."""
    return uuid.uuid4().hex[:16]


class Watches:
    """Starts, numbers, publishes and restarts a lane's standing watches.

    Owns ``_runs`` (the current run of each watch this lane runs), ``_failures`` (failed runs
    in a row, per watch) and ``_restarts`` (the pending restarts); nothing else writes them.
    """

    def __init__(
        self,
        *,
        route: OutcomeRoute,
        supervisor: TriggerSupervisor,
        sink: EventSink,
        read: RecordReader,
        queue: str | None,
        metrics: TriggererMetrics,
        log: Callable[..., dict[str, Any]],
    ) -> None:
        self._route = route
        self._supervisor = supervisor
        self._sink = sink
        self._read = read
        self._queue = queue
        self._label = queue or "default"
        self._metrics = metrics
        self._log = log
        self._runs: dict[str, WatchRef] = {}
        self._failures: dict[str, int] = {}
        self._restarts: dict[str, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def start(
        self,
        part: OwnedPartition,
        key: bytes,
        value: bytes,
        request: WatchRequest,
        trigger: BaseTrigger,
        *,
        reason: str = "first",
    ) -> None:
        """Start a run of the watch ``key`` (a no-op while one runs here)."""
        tid = request.trigger_id
        if tid in self._supervisor:
            return
        pending = self._restarts.pop(tid, None)
        if pending is not None:
            pending.cancel()
        if key in part.book.done:
            return  # a watch that ended here (once): its tombstone is on its way
        ref = WatchRef(self._route, part, key, value, run=new_run_id(), once=request.once)
        self._runs[tid] = ref
        self._supervisor.add(tid, trigger, context=ref, max_events=None)
        self._metrics.watch_runs.labels(queue=self._label, reason=reason).inc()
        logger.info(
            "watch started",
            extra=self._log(part.number, trigger_id=tid, run=ref.run, reason=reason),
        )

    def outcome(self, ref: WatchRef, outcome: TriggerOutcome) -> None:
        """An event or the failure of a run: numbered, then published, held or dropped by
        its partition's phase; a run that ended is started again later."""
        source = outcome.source
        if source is None:
            ref.seq += 1
            run, seq = ref.run, ref.seq
        else:  # named after its record: the same record read again is the same event
            run, seq = source_run(source.partition), source.offset + 1
        numbered = outcome._replace(event_id=make_watch_event_id(outcome.trigger_id, run, seq))
        book = ref.part.book
        if book.emitting:
            self.publish(ref, numbered)
        elif not book.hold((ref, numbered)):
            self._dropped(ref)
        if outcome.final and ref.once:
            self._forget(outcome.trigger_id)  # it ends with this run: never started again
        elif outcome.final:
            self._ended(ref, fired=outcome.status == "fired")

    def publish(self, ref: WatchRef, outcome: TriggerOutcome) -> None:
        """Queue a numbered outcome of ``ref`` on the resume topic; a ``once`` watch's last
        is tombstoned with it (in one transaction where there are transactions)."""
        failed = outcome.status != "fired"
        ends = ref.once and outcome.final
        part = ref.part
        if ends:
            part.book.claim(ref.key)  # the tombstone read back is this lane's own
            part.table.note_emitting(ref.key)
        _, run, seq = outcome.event_id.rsplit(":", 2)
        record = WatchEvent(
            event_id=outcome.event_id,
            trigger_id=outcome.trigger_id,
            run=run,
            seq=int(seq),
            status="failed" if failed else "fired",
            payload=None if failed else outcome.payload,
            error=(outcome.error or "the watch's run timed out") if failed else None,
            traceback=outcome.traceback,
            last=outcome.final,
            member=self._route.member,
            partition=part.number,
            queue=self._queue,
        )
        self._sink.watch_event(part, ref.key, record, tombstone=ends, source=outcome.source)

    def _dropped(self, ref: WatchRef) -> None:
        self._metrics.watch_events_dropped.labels(queue=self._label).inc()
        logger.warning(
            "watch event dropped: its partition is no longer emitting here",
            extra=self._log(ref.part.number, trigger_id=ref.key.decode(errors="replace")),
        )

    def _ended(self, ref: WatchRef, *, fired: bool) -> None:
        tid = ref.key.decode(errors="replace")
        if self._runs.get(tid) is not ref:
            return
        failures = 0 if fired else self._failures.get(tid, 0) + 1
        if failures:
            self._failures[tid] = failures
        else:
            self._failures.pop(tid, None)
        delay = restart_delay(failures)
        loop = asyncio.get_running_loop()
        self._restarts[tid] = loop.call_later(delay, self._restart, ref, failures)
        logger.info(
            "watch run ended; starting it again in %.0f s",
            delay,
            extra=self._log(ref.part.number, trigger_id=tid, run=ref.run, failed_in_a_row=failures),
        )

    def _restart(self, ref: WatchRef, failures: int) -> None:
        tid = ref.key.decode(errors="replace")
        self._restarts.pop(tid, None)
        part = ref.part
        if self._runs.get(tid) is not ref:
            return  # started again meanwhile (a new request), or forgotten
        entry = part.table.get(ref.key)
        if part.book.phase not in _RUNNING_PHASES or entry is None:
            self._forget(tid)
            return
        if tid in self._supervisor:  # the last run still cleaning up: a moment more
            loop = asyncio.get_running_loop()
            self._restarts[tid] = loop.call_later(RESTART_AFTER_END, self._restart, ref, failures)
            return
        decision = self._read(ref.key, entry.value)
        if isinstance(decision, StartWatch):
            reason = "failed" if failures else "ended"
            self.start(
                part, ref.key, entry.value, decision.request, decision.trigger, reason=reason
            )
            return
        error = getattr(decision, "error", None)
        if error is None:  # no longer a watch: what replaced it was dispatched already
            self._forget(tid)
            return
        # The trigger could be built before and not now (its __init__ failed): a failed run.
        logger.warning(
            "watch not started again: %s",
            error,
            extra=self._log(part.number, trigger_id=tid),
        )
        self._ended(ref, fired=False)

    def forget(self, trigger_ids: Iterable[str]) -> None:
        """The watches ``trigger_ids`` no longer run here (tombstoned, or their partition
        lost or released): no run of them starts again."""
        for tid in trigger_ids:
            self._forget(tid)

    def forget_partition(self, part: OwnedPartition) -> None:
        """Every watch of ``part`` no longer runs here."""
        self.forget([tid for tid, ref in self._runs.items() if ref.part is part])

    def _forget(self, tid: str) -> None:
        self._runs.pop(tid, None)
        self._failures.pop(tid, None)
        pending = self._restarts.pop(tid, None)
        if pending is not None:
            pending.cancel()

    def close(self) -> None:
        """Stop every pending restart (the lane is closing)."""
        for pending in self._restarts.values():
            pending.cancel()
        self._restarts.clear()
        self._runs.clear()
        self._failures.clear()
