"""Re-drive a stuck trigger: publish its recorded DeferRequest again, under its own trigger id.

Why the same trigger id and not a fresh deferral: the task state says "deferred on trigger T"
and the scheduler applies an event only while that holds, so only an event of T can resume
the task. Re-publishing T's request (same key, same partition) replaces itself in the
compacted defer topic, a triggerer already running T ignores it, and if two events of T ever
reach the scheduler the first moves the task off "deferred" and the second is dropped as a
duplicate: a double resume is impossible. A fresh trigger id would be stale on arrival.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka.errors import KafkaError
from deferline.schemas import DeferRequest, encode
from deferline.topics import Settings, make_producer, start_client, stop_client

from ._errors import ReplayError
from ._explain import explain_trigger
from ._fold import ReplayIndex
from ._records import REDRIVE_HEADER
from ._verdict import ReplayContext, Verdict, VerdictKind

__all__ = ["RedrivePlan", "plan_redrive", "publish_redrives"]

logger = logging.getLogger(__name__)

_DEAD = frozenset(
    {
        VerdictKind.CLASSPATH_NOT_ALLOWED,
        VerdictKind.IMPORT_ERROR,
        VerdictKind.UNDECRYPTABLE_KWARGS,
        VerdictKind.BAD_REQUEST,
    }
)


@dataclass(frozen=True, slots=True)
class RedrivePlan:
    """What re-driving one trigger would do, and why."""

    trigger_id: str
    action: Literal["publish", "skip"]
    reason: str
    verdict: Verdict
    request: DeferRequest | None = None
    topic: str | None = None
    partition: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "trigger_id": self.trigger_id,
            "action": self.action,
            "reason": self.reason,
            "topic": self.topic,
            "partition": self.partition,
            "verdict": self.verdict.kind.value,
            "ti_key": self.verdict.task.ti_key if self.verdict.task else None,
        }


def plan_redrive(
    index: ReplayIndex, trigger_id: str, ctx: ReplayContext, *, force: bool = False
) -> RedrivePlan:
    """Decide whether re-publishing this trigger's DeferRequest is safe and useful.

    Refused always: no recorded request; the task is not deferred on this trigger (its event
    would be stale); a cancel is pending or done (re-publishing would undo the cancel in the
    compacted topic). Refused unless ``force``: the trigger already has an event (normally
    the scheduler just has not applied it yet), or it was dead-lettered (it would be again
    until the configuration is fixed).
    """
    verdict = explain_trigger(index, trigger_id, ctx)
    history = index.triggers.get(trigger_id)
    rec = history.request if history else None

    def skip(reason: str) -> RedrivePlan:
        return RedrivePlan(trigger_id, "skip", reason, verdict)

    if history is not None and history.is_watch:
        return skip(
            "a standing watch, not a deferral: no task waits on it, and its triggerer starts "
            "a run that ended again by itself while its WatchRequest is active"
        )
    if history is None or rec is None or not isinstance(rec.record, DeferRequest):
        return skip("no DeferRequest recorded for this trigger (nothing to re-publish)")
    request = rec.record
    task = index.tasks.get(request.task.ti_key)
    state = task.state if task else None
    if state is None or state.state != "deferred" or state.trigger_id != trigger_id:
        now = f"{state.state} on {state.trigger_id or 'no trigger'}" if state else "unknown"
        return skip(f"the task is not deferred on this trigger (it is {now}): nothing to resume")
    if history.cancels or verdict.kind is VerdictKind.CANCELLED:
        return skip("a cancel was requested: re-publishing would undo it")
    if verdict.kind in _DEAD and not force:
        return skip(
            f"dead-lettered ({verdict.cause}): fix the configuration, then re-drive with --force"
        )
    if history.events and not force:
        return skip(
            f"already has an event ({verdict.kind.value}): the scheduler applies it when it "
            "reads it; --force re-publishes anyway (a second event is dropped as a duplicate)"
        )
    note = "re-publish the recorded DeferRequest under its own trigger id"
    if history.alive:
        note += " (still active on the defer topic: a triggerer already running it ignores it)"
    if request.timeout_at is not None and request.timeout_at <= ctx.now:
        note += "; its timeout has passed, so it will time out at once and fail the task"
    return RedrivePlan(
        trigger_id,
        "publish",
        note,
        verdict,
        request=request,
        topic=rec.position.topic,
        partition=rec.position.partition,
    )


async def publish_redrives(settings: Settings, plans: list[RedrivePlan]) -> int:
    """Publish the plans marked ``publish``; returns how many were acknowledged."""
    todo = [p for p in plans if p.action == "publish"]
    if not todo:
        return 0
    producer = make_producer(settings)
    stamp = dt.datetime.now(dt.UTC).isoformat().encode()
    done = 0
    try:
        await start_client(producer, grace=5.0, name="re-drive producer")
        for plan in todo:
            assert plan.request is not None
            assert plan.topic is not None
            await producer.send_and_wait(
                plan.topic,
                encode(plan.request),
                key=plan.trigger_id.encode(),
                partition=plan.partition,
                headers=[(REDRIVE_HEADER, stamp)],
            )
            done += 1
            logger.info(
                "trigger re-driven",
                extra={
                    "trigger_id": plan.trigger_id,
                    "task": str(plan.request.task),
                    "partition": plan.partition,
                    "topic": plan.topic,
                },
            )
    except KafkaError as exc:
        raise ReplayError(f"re-drive failed after {done} of {len(todo)} published: {exc}") from exc
    finally:
        await stop_client(producer, grace=5.0, name="re-drive producer")
    return done
