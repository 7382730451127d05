"""Encode a trigger's event straight from its stored DeferRequest bytes (the hot path).

Every fired trigger turns into one TriggerEventRecord. Building it through pydantic means
validating the DeferRequest again and then the event; the request was
validated when the trigger started, so the event's JSON is assembled here with orjson
from the request's own JSON and the outcome. The result is the wire form of
:class:`~deferline.schemas.TriggerEventRecord` (a unit test checks it decodes to the same
record as the pydantic path).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import orjson
from deferline.schemas import SCHEMA_VERSION, MomentTagger, dumps_kept, to_tagged

__all__ = ["EventEncoder", "encode_event", "request_fields"]


def request_fields(value: bytes) -> dict[str, Any]:
    """The stored DeferRequest as a plain JSON object (already validated at start)."""
    raw: dict[str, Any] = orjson.loads(value)
    return raw


def _when(moment: dt.datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


class EventEncoder:
    """:func:`encode_event` with what a burst shares computed once.

    Timers falling due together mostly share their due time and payload (a
    ``DateTimeTrigger`` fires with its moment): the last of each is kept with its encoded
    form and reused while equal, so the bytes are those :func:`encode_event` gives.
    """

    __slots__ = ("_due", "_due_text", "tagged")

    def __init__(self) -> None:
        self._due: dt.datetime | None = None
        self._due_text: str | None = None
        self.tagged = MomentTagger()  # the payload, tagged

    def emitted_at(self) -> str:
        """Now in UTC as ISO 8601, to the microsecond (never rounded: rebalance checks
        compare it with the moments a partition was quiesced)."""
        return dt.datetime.now(dt.UTC).isoformat()

    def due(self, moment: dt.datetime | None) -> str | None:
        if moment is None:
            return None
        last = self._due
        if last is None or moment != last or moment.tzinfo is not last.tzinfo:
            self._due, self._due_text = moment, moment.isoformat()
        return self._due_text

    def encode(
        self,
        request: dict[str, Any],
        *,
        event_id: str,
        trigger_id: str,
        status: str,
        payload: Any,
        task_outcome: str | None,
        xcoms: dict[str, Any] | None,
        error: str | None,
        traceback: str | None,
        due_at: dt.datetime | None,
        member: str | None,
        partition: int | None,
        queue: str | None,
        resumed_directly: bool,
    ) -> bytes:
        """The wire JSON of the TriggerEventRecord (see :func:`encode_event`), emitted now."""
        return dumps_kept(  # held until acked: not in orjson's 4 KB buffer
            {
                "version": SCHEMA_VERSION,
                "kind": "trigger_event",
                "event_id": event_id,
                "trigger_id": trigger_id,
                "task": request["task"],
                "defer_seq": request.get("defer_seq", 0),
                "status": status,
                "payload": self.tagged(payload),
                "task_outcome": task_outcome,
                "xcoms": None if xcoms is None else to_tagged(xcoms),
                "error": error,
                "traceback": traceback,
                "due_at": self.due(due_at),
                "emitted_at": self.emitted_at(),
                "member": member,
                "partition": partition,
                "queue": queue,
                "resumed_directly": resumed_directly,
            }
        )


def encode_event(
    request: dict[str, Any],
    *,
    event_id: str,
    trigger_id: str,
    status: str,
    payload: Any = None,
    task_outcome: str | None = None,
    xcoms: dict[str, Any] | None = None,
    error: str | None = None,
    traceback: str | None = None,
    due_at: dt.datetime | None = None,
    emitted_at: dt.datetime,
    member: str | None,
    partition: int | None,
    queue: str | None,
    resumed_directly: bool = False,
) -> bytes:
    """The wire JSON of the TriggerEventRecord for ``request`` (a :func:`request_fields`)."""
    return dumps_kept(
        {
            "version": SCHEMA_VERSION,
            "kind": "trigger_event",
            "event_id": event_id,
            "trigger_id": trigger_id,
            "task": request["task"],
            "defer_seq": request.get("defer_seq", 0),
            "status": status,
            "payload": to_tagged(payload),
            "task_outcome": task_outcome,
            "xcoms": None if xcoms is None else to_tagged(xcoms),
            "error": error,
            "traceback": traceback,
            "due_at": _when(due_at),
            "emitted_at": _when(emitted_at),
            "member": member,
            "partition": partition,
            "queue": queue,
            "resumed_directly": resumed_directly,
        }
    )
