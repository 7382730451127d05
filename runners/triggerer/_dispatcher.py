"""What a lane does with the defer records of a partition: start, cancel, dead-letter."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

from deferline.engine import TriggerSupervisor
from deferline.schemas import (
    DeadLetter,
    TaskKey,
    TriggerEventRecord,
    WatchEvent,
    make_event_id,
    make_watch_event_id,
)

from ._event_sink import EventSink
from ._input import BadRecord, CancelTrigger, RecordReader, StartTrigger, StartWatch
from ._lane_types import OutcomeRoute, OwnedPartition, StopTrigger, TriggerRef
from ._metrics import TriggererMetrics
from ._rebuild_plan import Record
from ._watches import Watches

logger = logging.getLogger(__name__)

REFUSED_RUN = "rejected"
"""The run id of the one event of a watch that cannot run (its record refused)."""


class RecordDispatcher:
    """Interprets records of the defer topic and acts on each (no table of its own: the
    partition's table and book are the partition's)."""

    def __init__(
        self,
        route: OutcomeRoute,
        *,
        queue: str | None,
        label: str,
        defer_topic: str,
        supervisor: TriggerSupervisor,
        sink: EventSink,
        watches: Watches,
        read: RecordReader,
        cancel: StopTrigger,
        metrics: TriggererMetrics,
        log: Callable[..., dict[str, Any]],
    ) -> None:
        self._route = route
        self._supervisor = supervisor
        self._sink = sink
        self._watches = watches
        self._read = read
        self._cancel = cancel
        self._metrics = metrics
        self._log = log
        self._label = label
        self._defer_topic = defer_topic
        self._member = route.member
        self._queue = queue
        self.deferrals = metrics.deferrals.labels(queue=self._label)

    def apply_live(self, part: OwnedPartition, records: Sequence[Record]) -> None:
        """Fold a batch from the group consumer into the table and act on each record."""
        table = part.table
        deferrals = 0
        for record in records:
            if record.offset < table.defer_offset:
                continue  # already folded (redelivery after a seek)
            key, value = record.key, record.value
            if key is None:
                table.skip(record.offset)
                if value is not None:
                    self.dispatch(part, None, value, record.offset)
                continue
            table.apply(key, value, offset=record.offset, timestamp=record.timestamp)
            if value is None:
                self._tombstoned(part, key)
            else:
                deferrals += self.dispatch(part, key, value, record.offset)
        if deferrals:
            self.deferrals.inc(deferrals)

    def _tombstoned(self, part: OwnedPartition, key: bytes) -> None:
        if part.book.tombstoned(key):
            return
        tid = key.decode(errors="replace")
        self._watches.forget((tid,))
        if tid in self._supervisor:
            # Someone else finished it (an earlier owner's late tombstone): stop our copy.
            logger.info(
                "trigger tombstoned elsewhere; stopping it",
                extra=self._log(part.number, trigger_id=tid),
            )
            self._cancel(tid)

    def dispatch(self, part: OwnedPartition, key: bytes | None, value: bytes, offset: int) -> bool:
        """Act on one non-tombstone value: start, cancel, or dead-letter it.

        True when it is a deferral, for the caller's count (one counter update per batch).
        """
        decision = self._read(key, value)
        if isinstance(decision, StartTrigger):
            assert key is not None
            request = decision.request
            if key in part.book.done or request.trigger_id in self._supervisor:
                return True  # the same deferral again: keep the running copy
            ref = TriggerRef(self._route, part, key, value)
            self._supervisor.add(
                request.trigger_id, decision.trigger, timeout_at=request.timeout_at, context=ref
            )
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "trigger started",
                    extra=self._log(
                        part.number,
                        trigger_id=request.trigger_id,
                        task=str(request.task),
                        classpath=request.classpath,
                    ),
                )
            return True
        if isinstance(decision, StartWatch):
            assert key is not None
            self._watches.start(part, key, value, decision.request, decision.trigger)
            return False
        if isinstance(decision, CancelTrigger):
            assert key is not None
            self._cancelled(part, key, decision)
            return False
        self._dead_letter(part, key, value, offset, decision)
        return False

    def _cancelled(self, part: OwnedPartition, key: bytes, decision: CancelTrigger) -> None:
        cancel = decision.request
        self._metrics.cancel_requests.labels(queue=self._label).inc()
        if not part.book.claim(key):
            return
        part.table.note_emitting(key)
        if cancel.trigger_id in self._supervisor:
            self._cancel(cancel.trigger_id, kill=True)  # a user's action: on_kill()
        record = self._event(
            part, cancel.trigger_id, cancel.task, cancel.defer_seq, "cancelled", cancel.reason
        )
        logger.info(
            "trigger cancelled",
            extra=self._log(
                part.number,
                trigger_id=cancel.trigger_id,
                task=str(cancel.task),
                reason=cancel.reason,
            ),
        )
        self._sink.record(part, key, record)

    def tombstone_only(
        self, part: OwnedPartition, key: bytes, event_offset: int, event: bytes | None
    ) -> None:
        """The event is already on the resume topic: only the tombstone is missing (and
        perhaps the event's copy on tasks.events: it is sent again first)."""
        part.book.claim(key)
        part.table.note_emitting(key)
        part.table.note_event_offset(key, event_offset)
        logger.info(
            "trigger already emitted; copying its event to tasks.events again (when events "
            "are copied) and writing its missing tombstone",
            extra=self._log(part.number, trigger_id=key.decode(errors="replace")),
        )
        self._sink.tombstone(part, key, event)

    def _dead_letter(
        self, part: OwnedPartition, key: bytes | None, value: bytes, offset: int, bad: BadRecord
    ) -> None:
        letter = DeadLetter(
            topic=self._defer_topic,
            partition=part.number,
            offset=offset,
            key=key,
            value=value,
            error=bad.error,
            error_type=bad.error_type,
            member=self._member,
            trigger_id=bad.trigger_id,
            task=bad.task,
        )
        logger.warning(
            "bad record dead-lettered: %s: %s",
            bad.error_type,
            bad.error,
            extra=self._log(
                part.number,
                trigger_id=bad.trigger_id,
                task=str(bad.task) if bad.task else None,
                offset=offset,
                error_type=bad.error_type,
            ),
        )
        self._metrics.dead_letters.labels(queue=self._label, reason=bad.error_type).inc()
        if key is not None:
            part.book.claim(key)
            part.table.note_emitting(key)
        if bad.watch and key is not None and bad.trigger_id is not None:
            self._watch_refused(part, key, bad, letter)
            return
        if not bad.identified:
            self._sink.dead_letter(letter, part=part, event=None)
            return
        assert bad.trigger_id is not None
        assert bad.task is not None
        error = f"{bad.error_type}: {bad.error}"
        record = self._event(part, bad.trigger_id, bad.task, bad.defer_seq, "failed", error)
        self._sink.dead_letter(letter, part=part, event=(key or bad.trigger_id.encode(), record))

    def _watch_refused(
        self, part: OwnedPartition, key: bytes, bad: BadRecord, letter: DeadLetter
    ) -> None:
        """A watch that cannot run: its failure as its one and last WatchEvent (run
        ``rejected``: the same id however often it is refused), its dead letter and its
        tombstone, together."""
        assert bad.trigger_id is not None
        error = f"{bad.error_type}: {bad.error}"
        record = WatchEvent(
            event_id=make_watch_event_id(bad.trigger_id, REFUSED_RUN, 1),
            trigger_id=bad.trigger_id,
            run=REFUSED_RUN,
            seq=1,
            status="failed",
            error=error,
            last=True,
            member=self._member,
            partition=part.number,
            queue=self._queue,
        )
        self._sink.watch_event(part, key, record, tombstone=True, letter=letter)

    def _event(
        self,
        part: OwnedPartition,
        trigger_id: str,
        task: TaskKey,
        defer_seq: int,
        status: Literal["cancelled", "failed"],
        reason: str,
    ) -> TriggerEventRecord:
        """The event of a trigger ended by its record (a cancel, or bad input)."""
        payload = {"reason": reason} if status == "cancelled" else {"error": reason}
        return TriggerEventRecord(
            event_id=make_event_id(trigger_id, status, payload),
            trigger_id=trigger_id,
            task=task,
            defer_seq=defer_seq,
            status=status,
            payload=payload,
            error=reason,
            member=self._member,
            partition=part.number,
            queue=self._queue,
        )
