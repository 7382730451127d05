"""A lane's outcomes: supervisor events queued on the emitter, and their acks and failures."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deferline.engine import TriggerOutcome
from deferline.schemas import (
    DeferRequest,
    RunTask,
    TaskKey,
    TriggerEventRecord,
    decode_as,
    encode,
    make_event_id,
)

from ._emitter import Emission, Send
from ._events import request_fields
from ._input import peek_identity
from ._lane_state import _LaneCore
from ._lane_types import OwnedPartition, TriggerRef

logger = logging.getLogger(__name__)


_UNPRODUCIBLE = {"error": "event not producible"}


def _unproducible_id(trigger_id: str) -> str:
    return make_event_id(trigger_id, "failed", _UNPRODUCIBLE)


@dataclass(slots=True, eq=False)
class _EventInfo:
    """What the ack and failure callbacks of one queued event need to know."""

    trigger_id: str
    status: str
    event_id: str
    direct: bool
    value: bytes | None = None
    """The stored DeferRequest (hot path: decoded only if a log line or a failure needs it)."""
    task_key: TaskKey | None = None
    seq: int = 0

    def task(self) -> TaskKey | None:
        return self.task_key if self.task_key is not None else peek_identity(self.value)[1]

    def defer_seq(self) -> int:
        return peek_identity(self.value)[2] if self.value is not None else self.seq


@dataclass(slots=True, eq=False)
class _QueuedEvent:
    """One event in the emitter; its ack and failure callbacks (one small object each)."""

    lane: _Outcomes
    part: OwnedPartition | None
    key: bytes
    number: int
    tombstone: bool
    info: _EventInfo

    def acked(self, metadata: Sequence[Any]) -> None:
        self.lane._event_acked(self, int(metadata[0].offset))

    def failed(self, error: BaseException) -> None:
        self.lane._event_failed(self, error)


class _Outcomes(_LaneCore):
    """Outcome handling of a :class:`TriggerLane` (a part of it, not used alone)."""

    def handle_outcome(self, ref: TriggerRef, outcome: TriggerOutcome) -> None:
        """An event from the supervisor (synchronous): queue it, then cancel the trigger."""
        part = self._parts.get(ref.partition)
        if part is None or not part.live:
            self._hold_or_drop(part, ref, outcome)
            return
        key = ref.key
        if part is not None and key in part.done:
            self._metrics.extra_events_dropped.inc()
            if not outcome.final:
                self._cancel(outcome.trigger_id)
            return
        if part is not None:
            part.done.add(key)
            part.table.note_emitting(key)
        if not outcome.final:
            # The first event resumes the task; a multi-event trigger is stopped here.
            self._cancel(outcome.trigger_id)
        fields = request_fields(ref.value)
        direct = (
            self.options.direct_resume
            and fields.get("resume") is not None
            and outcome.status == "fired"
            and outcome.task_outcome is None
        )
        encoded = self._encoder.encode(
            fields,
            event_id=outcome.event_id,
            trigger_id=outcome.trigger_id,
            status=outcome.status,
            payload=outcome.payload,
            task_outcome=outcome.task_outcome,
            xcoms=outcome.xcoms,
            error=outcome.error,
            traceback=outcome.traceback,
            due_at=outcome.due_at,
            member=self.member,
            partition=ref.partition,
            queue=self.queue,
            resumed_directly=direct,
        )
        extra: list[Send] = []
        if direct:
            request = decode_as(ref.value, DeferRequest)
            assert request.resume is not None
            target = request.resume
            run = RunTask(
                task=request.task,
                mode="resume",
                operator=target.operator,
                op_kwargs=target.op_kwargs,
                next_method=request.next_method,
                next_kwargs=request.next_kwargs,
                event=outcome.payload,
                event_id=outcome.event_id,
                trigger_id=request.trigger_id,
                defer_seq=request.defer_seq,
                worker_queue=target.worker_queue,
                pool=target.pool,
                pool_slots=target.pool_slots,
                priority_weight=target.priority_weight,
                retries=target.retries,
            )
            extra.append(
                Send(
                    self.names.resumes(target.worker_queue),
                    request.task.ti_key.encode(),
                    encode(run),
                )
            )
        self._submit_event(
            part,
            key,
            encoded,
            _EventInfo(outcome.trigger_id, outcome.status, outcome.event_id, direct, ref.value),
            extra=extra,
            partition=ref.partition,
        )

    def _hold_or_drop(
        self, part: OwnedPartition | None, ref: TriggerRef, outcome: TriggerOutcome
    ) -> None:
        """An outcome for a partition this lane does not emit for now (rebalance, release)."""
        if part is not None and part.quiesced_at is not None:
            part.held.append((ref, outcome))  # emitted if the partition stays here
            return
        # Lost to another member or being released (its trigger is being cancelled, or
        # stopped at shutdown): the next owner fires it.
        logger.debug(
            "outcome of a partition not emitted for dropped",
            extra=self._log(ref.partition, trigger_id=outcome.trigger_id),
        )

    def _submit_record(
        self,
        part: OwnedPartition | None,
        key: bytes,
        record: TriggerEventRecord,
        *,
        extra: Sequence[Send] = (),
        partition: int | None = None,
        tombstone: bool = True,
    ) -> None:
        """Queue an event built as a record (cancels, bad input: the rare paths)."""
        info = _EventInfo(
            record.trigger_id,
            record.status,
            record.event_id,
            False,
            task_key=record.task,
            seq=record.defer_seq,
        )
        self._submit_event(
            part, key, encode(record), info, extra=extra, partition=partition, tombstone=tombstone
        )

    def _submit_event(
        self,
        part: OwnedPartition | None,
        key: bytes,
        encoded: bytes,
        info: _EventInfo,
        *,
        extra: Sequence[Send],
        partition: int | None = None,
        tombstone: bool = True,
    ) -> None:
        number = part.number if part is not None else partition
        assert number is not None
        queued = _QueuedEvent(self, part, key, number, tombstone, info)
        self._emitter.submit(
            Emission(
                sends=(Send(self.resume_topic, key, encoded, number), *extra),
                tombstone=Send(self.defer_topic, key, None, number) if tombstone else None,
                on_acked=queued.acked,
                on_failed=queued.failed,
            )
        )

    def _event_acked(self, queued: _QueuedEvent, offset: int) -> None:
        info = queued.info
        current = self._parts.get(queued.number)
        if current is not None and current is queued.part:
            current.table.note_event_offset(queued.key, offset)
        counter = self._event_counters.get(info.status)
        if counter is None:
            counter = self._metrics.events.labels(queue=self.label, status=info.status)
            self._event_counters[info.status] = counter
        counter.inc()
        if info.direct:
            self._metrics.direct_resumes.labels(queue=self.label).inc()
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "trigger event produced",
                extra=self._log(
                    queued.number,
                    trigger_id=info.trigger_id,
                    task=str(info.task()),
                    status=info.status,
                    event_id=info.event_id,
                ),
            )

    def _event_failed(self, queued: _QueuedEvent, error: BaseException) -> None:
        """The event itself cannot be produced (too large, say): tell the task why instead."""
        info = queued.info
        if info.status == "failed" and info.event_id == _unproducible_id(info.trigger_id):
            return
        task = info.task()
        if task is None:
            logger.error(
                "event not producible and its task unknown",
                extra=self._log(queued.number, trigger_id=info.trigger_id, error=repr(error)),
            )
            return
        replacement = TriggerEventRecord(
            event_id=_unproducible_id(info.trigger_id),
            trigger_id=info.trigger_id,
            task=task,
            defer_seq=info.defer_seq(),
            status="failed",
            payload=_UNPRODUCIBLE,
            error=f"the trigger's event could not be produced: {error!r}",
            member=self.member,
            partition=queued.number,
            queue=self.queue,
        )
        self._submit_record(
            queued.part,
            queued.key,
            replacement,
            partition=queued.number,
            tombstone=queued.tombstone,
        )
