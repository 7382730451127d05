"""A lane's live tail: records applied to the table and interpreted (start, cancel, dead-letter)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from deferline.schemas import DeadLetter, TriggerEventRecord, encode, make_event_id
from deferline.topics import trace_receive

from ._emitter import Emission, Send
from ._input import BadRecord, CancelTrigger, StartTrigger, interpret
from ._lane_outcomes import _Outcomes
from ._lane_types import OwnedPartition, TriggerRef

logger = logging.getLogger(__name__)


class _Tail(_Outcomes):
    """Record handling of a :class:`TriggerLane` (a part of it, not used alone)."""

    def _apply_live(self, part: OwnedPartition, records: Sequence[Any]) -> None:
        table = part.table
        deferrals = 0
        for record in records:
            if record.offset < table.defer_offset:
                continue  # already folded (redelivery after a seek)
            key, value = record.key, record.value
            trace_receive(record.topic, value, record.headers)
            if key is None:
                table.skip(record.offset)
                if value is not None:
                    self._dispatch(part, None, value, record.offset)
                continue
            table.apply(key, value, offset=record.offset, timestamp=record.timestamp)
            if value is None:
                self._on_tombstone(part, key)
            else:
                deferrals += self._dispatch(part, key, value, record.offset)
        if deferrals:
            self._deferrals.inc(deferrals)

    def _on_tombstone(self, part: OwnedPartition, key: bytes) -> None:
        if key in part.done:
            part.done.discard(key)
            return
        tid = key.decode(errors="replace")
        if tid in self._supervisor:
            # Someone else finished it (an earlier owner's late tombstone): stop our copy.
            logger.info(
                "trigger tombstoned elsewhere; stopping it",
                extra=self._log(part.number, trigger_id=tid),
            )
            self._cancel(tid)

    def _dispatch(self, part: OwnedPartition, key: bytes | None, value: bytes, offset: int) -> bool:
        """Act on one non-tombstone value: start, cancel, or dead-letter it.

        True when it is a deferral, for the caller's count (one counter update per batch).
        """
        decision = interpret(
            key, value, allowed_prefixes=self._allowed, cipher=self._cipher, classes=self._classes
        )
        if isinstance(decision, StartTrigger):
            assert key is not None
            request = decision.request
            if key in part.done or request.trigger_id in self._supervisor:
                return True  # the same deferral again: keep the running copy
            ref = TriggerRef(self, part.number, key, value)
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
        if isinstance(decision, CancelTrigger):
            assert key is not None
            cancel = decision.request
            self._metrics.cancel_requests.labels(queue=self.label).inc()
            if key in part.done:
                return False
            part.done.add(key)
            part.table.note_emitting(key)
            if cancel.trigger_id in self._supervisor:
                self._cancel(cancel.trigger_id, kill=True)  # a user's action: on_kill()
            payload = {"reason": cancel.reason}
            record = TriggerEventRecord(
                event_id=make_event_id(cancel.trigger_id, "cancelled", payload),
                trigger_id=cancel.trigger_id,
                task=cancel.task,
                defer_seq=cancel.defer_seq,
                status="cancelled",
                payload=payload,
                error=cancel.reason,
                member=self.member,
                partition=part.number,
                queue=self.queue,
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
            self._submit_record(part, key, record)
            return False
        self._dead_letter(part, key, value, offset, decision)
        return False

    def _tombstone_only(self, part: OwnedPartition, key: bytes, event_offset: int) -> None:
        """The event is already on the resume topic: only the tombstone is missing."""
        part.done.add(key)
        part.table.note_emitting(key)
        part.table.note_event_offset(key, event_offset)
        logger.info(
            "trigger already emitted; writing its missing tombstone",
            extra=self._log(part.number, trigger_id=key.decode(errors="replace")),
        )
        self._emitter.submit(
            Emission(sends=(), tombstone=Send(self.defer_topic, key, None, part.number))
        )

    def _dead_letter(
        self, part: OwnedPartition, key: bytes | None, value: bytes, offset: int, bad: BadRecord
    ) -> None:
        letter = DeadLetter(
            topic=self.defer_topic,
            partition=part.number,
            offset=offset,
            key=key,
            value=value,
            error=bad.error,
            error_type=bad.error_type,
            member=self.member,
            trigger_id=bad.trigger_id,
            task=bad.task,
        )
        sends: list[Send] = [Send(self.names.dead, key, encode(letter), None)]
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
        self._metrics.dead_letters.labels(queue=self.label, reason=bad.error_type).inc()
        if key is not None:
            part.done.add(key)
            part.table.note_emitting(key)
        if bad.identified:
            assert bad.trigger_id is not None
            assert bad.task is not None
            error = f"{bad.error_type}: {bad.error}"
            payload = {"error": error}
            record = TriggerEventRecord(
                event_id=make_event_id(bad.trigger_id, "failed", payload),
                trigger_id=bad.trigger_id,
                task=bad.task,
                defer_seq=bad.defer_seq,
                status="failed",
                payload=payload,
                error=error,
                member=self.member,
                partition=part.number,
                queue=self.queue,
            )
            # A keyless record has no table entry to delete: event and letter only.
            self._submit_record(
                part, key or bad.trigger_id.encode(), record, extra=sends, tombstone=key is not None
            )
        else:
            tombstone = None if key is None else Send(self.defer_topic, key, None, part.number)
            self._emitter.submit(Emission(sends=sends, tombstone=tombstone))
