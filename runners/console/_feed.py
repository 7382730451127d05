"""Where each record read by the console goes: the loop figures, dead letters, failures.

Pure: :class:`RecordFeed` takes the records of every deferline topic (as the replay reader
hands them out) and keeps what the pages show, bounded: the latest state per task, the
newest dead letters, the newest trigger failures.
"""

from __future__ import annotations

import base64
import datetime as dt
from collections import deque
from typing import Any

import orjson
from deferline.replay import RawRecord, StuckScan, TopicRole

from ._loop import LoopStats

__all__ = ["RecordFeed"]

_KEEP = 200
"""Dead letters and failures kept (newest first)."""


def _text(value: bytes | None, limit: int = 2000) -> str | None:
    if value is None:
        return None
    return value[:limit].decode("utf-8", "replace")


class RecordFeed:
    """Routes records by topic role; everything it keeps is bounded except one entry per task.

    ``waiting`` is pass 1 of ``replay stuck`` kept up to date by the tail: the stuck list is
    read again only when the set of waiting tasks changes (or has aged), not on every refresh.
    """

    def __init__(self) -> None:
        self.loop = LoopStats()
        self.waiting = StuckScan()
        self.dead: deque[dict[str, Any]] = deque(maxlen=_KEEP)
        self.failed: deque[dict[str, Any]] = deque(maxlen=_KEEP)
        self.records = 0

    def feed(self, raw: RawRecord) -> None:
        self.records += 1
        role = raw.topic.role
        if role is TopicRole.TASKS:
            self.loop.task_state(raw.key, raw.value, raw.timestamp_ms)
            self.waiting.feed(raw)
        elif role is TopicRole.RESUME:
            self.loop.trigger_event(raw.value)
            if raw.value is not None and b'"failed"' in raw.value:
                self._failure(raw)
        elif role is TopicRole.DEAD:
            self._dead_letter(raw)

    def _failure(self, raw: RawRecord) -> None:
        assert raw.value is not None
        data = orjson.loads(raw.value)
        if not isinstance(data, dict) or data.get("status") != "failed":
            return
        task = data.get("task")
        self.failed.appendleft(
            {
                "trigger_id": data.get("trigger_id"),
                "ti_key": _ti_key(task),
                "error": data.get("error"),
                "at": data.get("emitted_at"),
                "member": data.get("member"),
                "position": f"{raw.topic.name}[{raw.partition}]@{raw.offset}",
            }
        )

    def _dead_letter(self, raw: RawRecord) -> None:
        ms = raw.timestamp_ms or 0
        at = dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat()
        entry: dict[str, Any] = {
            "at": at,
            "position": f"{raw.topic.name}[{raw.partition}]@{raw.offset}",
            "error_type": "undecodable",
            "error": None,
        }
        try:
            data = orjson.loads(raw.value) if raw.value is not None else None
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            original = data.get("value")
            try:
                value = base64.b64decode(original) if isinstance(original, str) else None
            except ValueError:
                value = None
            entry.update(
                at=data.get("failed_at") or at,
                error_type=data.get("error_type"),
                error=data.get("error"),
                source=f"{data.get('topic')}[{data.get('partition')}]@{data.get('offset')}",
                member=data.get("member"),
                trigger_id=data.get("trigger_id"),
                ti_key=_ti_key(data.get("task")),
                value=_text(value),
            )
        else:
            entry["value"] = _text(raw.value)
        self.dead.appendleft(entry)


def _ti_key(task: Any) -> str | None:
    if not isinstance(task, dict):
        return None
    parts = (task.get("dag_id"), task.get("task_id"), task.get("run_id"), task.get("map_index", -1))
    return "/".join(str(p) for p in parts) if all(p is not None for p in parts) else None
