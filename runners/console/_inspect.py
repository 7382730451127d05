"""Replay questions the console asks: the stuck list, one task's page, a re-drive.

Each is answered by the replay package (``ReplaySession``, its verdicts and its HTML
timeline), so the console says exactly what ``deferline replay`` says. A session reads the
topics afresh (no group, nothing committed); the stuck list is refreshed in the background,
never on a page load.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable
from typing import Any

from deferline.replay import (
    GroupHints,
    ReplaySession,
    ReportItem,
    Subject,
    WaitingTask,
    parse_subject,
    plan_redrive,
    publish_redrives,
    render_item,
)
from deferline.schemas import KwargsCipher
from deferline.topics import Settings

__all__ = ["Inspector"]

_WAITING_STATES = frozenset({"deferred", "queued", "scheduled"})
"""States in which a task's page shades the time it has been waiting."""

_FAILURES_EXPLAINED = 20
"""Newest trigger failures explained on the stuck list (each costs one replay read)."""

_NEW_FAILURES_PER_REFRESH = 5
"""New trigger failures explained per refresh at most (a storm of failures is caught up on)."""

_REREAD_S = 60.0
"""An unchanged stuck list is read again after this long (live owners may have changed)."""


class Inspector:
    """Runs replay sessions for the console's pages.

    Args:
        older_than: a task waiting on a trigger at least this long is on the stuck list.
        limit: the stuck list explains at most this many (the oldest); all are counted.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        hints: GroupHints,
        cipher: KwargsCipher | None,
        older_than: dt.timedelta,
        limit: int,
    ) -> None:
        self._settings = settings
        self._hints = hints
        self._cipher = cipher
        self.older_than = older_than
        self.limit = limit
        self._ended: dict[str, dict[str, Any]] = {}
        self.stuck: dict[str, Any] = {"waiting": [], "ended": [], "count": 0, "at": None}
        self._waiting: list[dict[str, Any]] = []
        self._read_keys: frozenset[str] | None = None
        self._read_at = 0.0

    def _session(self) -> ReplaySession:
        return ReplaySession(self._settings, hints=self._hints, cipher=self._cipher)

    async def refresh_stuck(
        self, waiting: Iterable[WaitingTask], failures: Iterable[dict[str, Any]]
    ) -> None:
        """Explain the tasks waiting too long (``replay stuck``) and new trigger failures.

        ``waiting`` is what the console's tail already knows waits: the replay read runs only
        when that set changed, or after ``_REREAD_S``; none waiting costs no read at all.
        """
        now = time.monotonic()
        keys = frozenset(w.ti_key for w in waiting)
        count = len(keys)
        if not keys:
            self._waiting = []
        elif keys != self._read_keys or now - self._read_at > _REREAD_S:
            async with self._session() as session:
                reports = await session.stuck(older_than=self.older_than, limit=self.limit)
                count = session.waiting_total
            self._waiting = [_brief(r.to_json()) for r in reports]
            self._read_at = now
        else:
            count = self.stuck["count"]
        self._read_keys = keys
        new = [
            f
            for f in list(failures)[:_FAILURES_EXPLAINED]
            if isinstance(f.get("trigger_id"), str) and f["trigger_id"] not in self._ended
        ]
        for failure in new[:_NEW_FAILURES_PER_REFRESH]:
            trigger_id = failure["trigger_id"]
            async with self._session() as session:
                verdict, _ = await session.why(Subject(trigger_id, trigger_id=trigger_id))
            self._ended[trigger_id] = {**verdict.to_json(), "ended_at": failure.get("at")}
        recent = sorted(self._ended.values(), key=lambda v: str(v["ended_at"]), reverse=True)
        for stale in recent[_FAILURES_EXPLAINED:]:
            self._ended.pop(str(stale["trigger_id"]), None)
        self.stuck = {
            "waiting": self._waiting,
            "ended": [_brief(v) for v in recent[:_FAILURES_EXPLAINED]],
            "count": count,
            "older_than_s": self.older_than.total_seconds(),
            "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }

    async def task_page(self, text: str) -> dict[str, Any]:
        """A task's (or trigger's) verdict, timeline picture and records, as the page shows."""
        subject = parse_subject(text)
        async with self._session() as session:
            verdict, entries = await session.why(subject)
            now = session.now
        events = [e for e in entries if e.kind == "trigger_event"]
        waiting = verdict.since if verdict.state in _WAITING_STATES else None
        trigger = next(
            (e.record.record for e in entries if e.kind == "defer_request" and e.record), None
        )
        return {
            "subject": subject.text,
            "verdict": _brief(verdict.to_json()),
            "classpath": getattr(trigger, "classpath", None),
            "events": len(events),
            "duplicates_dropped": sum(1 for e in events if e.decision == "duplicate"),
            "html": render_item(ReportItem(verdict, entries, waiting), now),
        }

    async def redrive(self, trigger_id: str) -> dict[str, Any]:
        """Publish a stuck trigger's request again, if ``replay redrive`` would."""
        async with self._session() as session:
            index = await session.collect(Subject(trigger_id, trigger_id=trigger_id))
            plan = plan_redrive(index, trigger_id, await session.context())
        published = await publish_redrives(self._settings, [plan])
        return {**plan.to_json(), "published": published}


def _brief(verdict: dict[str, Any]) -> dict[str, Any]:
    """What a list row needs (the evidence stays on the task's page)."""
    keep = ("subject", "verdict", "cause", "summary", "ti_key", "trigger_id", "state", "since")
    extra = ("waiting_since", "age_s", "ended_at")
    return {k: verdict.get(k) for k in (*keep, *extra) if k in verdict}
