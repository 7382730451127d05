"""Replay passes: which records to keep for a question, and the session that answers it.

Memory stays bounded by what the question needs, not by the size of the topics:

- ``why``/``timeline``: records are pre-filtered on their bytes (the trigger id, or the task's
  dag/task/run ids must appear) before decoding; a second pass follows links found in the first
  (a task's tombstones, a trigger's later task states).
- ``stuck``: pass 1 reads only the tasks topics and keeps the tasks whose latest state is
  waiting on a trigger; pass 2 reads every topic and keeps the records of those tasks and
  triggers. Triggerer events of other triggers are only peeked at for who owned which partition.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from deferline.schemas import KwargsCipher, TaskKey
from deferline.topics import Settings

from ._explain import explain, explain_task
from ._fold import ReplayIndex
from ._live import GroupHints, LiveView, read_live_view
from ._records import RawRecord, decode_raw
from ._source import ProgressSink, ReadBounds, TopicReader
from ._timeline import TimelineEntry, build_timeline, subject_ids
from ._topics import TopicInfo, TopicRole
from ._verdict import ReplayContext, Subject, Verdict

__all__ = ["ReplaySession", "StuckReport", "StuckScan", "WaitingTask", "subject_filter"]

logger = logging.getLogger(__name__)


def _parse_time(value: Any) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt.UTC)


@dataclass(frozen=True, slots=True)
class WaitingTask:
    """A task whose latest state waits on a trigger (deferred, or resumed and not started)."""

    ti_key: str
    state: str
    trigger_id: str
    since: dt.datetime | None


class StuckScan:
    """Pass 1 of ``stuck``: the latest state per task, kept only while it waits on a trigger.

    Values are peeked at with orjson (no model validation); a task whose latest state does not
    wait is forgotten, so memory follows the number of waiting tasks.
    """

    def __init__(self) -> None:
        self._waiting: dict[bytes, tuple[int, int, str, str, str | None]] = {}
        self.seen = 0
        self.undecodable = 0

    def feed(self, raw: RawRecord) -> None:
        self.seen += 1
        key = raw.key
        value = raw.value
        if value is None:
            if key is not None:
                self._waiting.pop(key, None)
            return
        try:
            data = orjson.loads(value)
        except orjson.JSONDecodeError:
            self.undecodable += 1
            return
        if not isinstance(data, dict) or data.get("kind") != "task_state":
            return
        if key is None:
            try:
                key = TaskKey.model_validate(data.get("task")).ti_key.encode()
            except ValueError:
                self.undecodable += 1
                return
        previous = self._waiting.get(key)
        position = (raw.partition, raw.offset)
        if previous is not None and previous[:2] > position and previous[0] == raw.partition:
            return  # an older record of the same partition (cannot happen in one pass)
        state = data.get("state")
        trigger_id = data.get("trigger_id")
        waiting = isinstance(trigger_id, str) and (
            state == "deferred"
            or (state in ("queued", "scheduled") and data.get("next_method") is not None)
        )
        if waiting:
            assert isinstance(trigger_id, str)
            updated = data.get("updated_at")
            self._waiting[key] = (
                raw.partition,
                raw.offset,
                str(state),
                trigger_id,
                updated if isinstance(updated, str) else None,
            )
        else:
            self._waiting.pop(key, None)

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self, *, now: dt.datetime, older_than: dt.timedelta) -> list[WaitingTask]:
        """Waiting tasks whose state is at least ``older_than`` old, oldest first."""
        found = []
        for key, (_, _, state, trigger_id, updated) in self._waiting.items():
            since = _parse_time(updated)
            if since is not None and now - since < older_than:
                continue
            found.append(WaitingTask(key.decode("utf-8", "replace"), state, trigger_id, since))
        far = dt.datetime.max.replace(tzinfo=dt.UTC)
        found.sort(key=lambda w: (w.since or far, w.ti_key))
        return found


def _task_needles(ti_key: str) -> tuple[bytes, ...]:
    dag_id, task_id, rest = ti_key.split("/", 2)
    run_id = rest.rsplit("/", 1)[0]
    return tuple(orjson.dumps(part) for part in (dag_id, task_id, run_id))


def subject_filter(
    *, trigger_ids: Iterable[str] = (), ti_keys: Iterable[str] = ()
) -> Callable[[RawRecord], bool]:
    """A byte-level pre-filter: keys match exactly, values must contain the ids.

    It may let through a record about another task (decoding decides); it never drops one
    that mentions a wanted trigger id or names the wanted task.
    """
    tids = {t.encode() for t in trigger_ids}
    keys = {k.encode() for k in ti_keys}
    needles = [_task_needles(k) for k in ti_keys]

    def wants(raw: RawRecord) -> bool:
        if raw.key is not None and (raw.key in tids or raw.key in keys):
            return True
        value = raw.value
        if value is None:
            return False
        if any(t in value for t in tids):
            return True
        return any(all(n in value for n in group) for group in needles)

    return wants


@dataclass(frozen=True, slots=True)
class StuckReport:
    """One stuck task: how long it waits and why."""

    waiting: WaitingTask
    verdict: Verdict
    age: dt.timedelta | None

    def to_json(self) -> dict[str, Any]:
        data = self.verdict.to_json()
        data["waiting_state"] = self.waiting.state
        data["waiting_since"] = self.waiting.since.isoformat() if self.waiting.since else None
        data["age_s"] = self.age.total_seconds() if self.age is not None else None
        return data


class ReplaySession:
    """Answers replay questions against a cluster: ``why``, ``timeline``, ``stuck``.

    ``live=False`` skips reading the consumer groups (verdicts then say the owner is unknown).
    ``now`` fixes the reference time (default: the time the session starts).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        bounds: ReadBounds | None = None,
        progress: ProgressSink | None = None,
        live: bool = True,
        hints: GroupHints | None = None,
        cipher: KwargsCipher | None = None,
        now: dt.datetime | None = None,
        batch_records: int = 10_000,
    ) -> None:
        self.settings = settings
        self.bounds = bounds or ReadBounds()
        self.reader = TopicReader(
            settings, bounds=self.bounds, progress=progress, batch_records=batch_records
        )
        self.read_live = live
        self.hints = hints or GroupHints.for_prefix(settings.topic_prefix)
        self.cipher = cipher
        self.now = now or dt.datetime.now(dt.UTC)
        self._live: LiveView | None = None
        self.index: ReplayIndex | None = None
        self.waiting_total = 0

    async def __aenter__(self) -> ReplaySession:
        await self.reader.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.reader.stop()

    async def context(self) -> ReplayContext:
        return ReplayContext(
            now=self.now,
            live=await self.live_view(),
            cipher=self.cipher,
            bounded=self.bounds.bounded,
            events_copied=self.settings.copy_events_to_tasks,
        )

    async def live_view(self) -> LiveView | None:
        """The consumer groups now (read once per session), or None when disabled."""
        if not self.read_live:
            return None
        if self._live is None:
            topics = await self.reader.topics()
            await self.reader.ranges(topics)
            partitions = {t.name: self.reader.partitions(t.name) for t in topics}
            self._live = await read_live_view(
                self.settings,
                topics=topics,
                end_offsets=self.reader.end_offsets(),
                partitions=partitions,
                hints=self.hints,
            )
        return self._live

    async def _fold(
        self,
        index: ReplayIndex,
        topics: list[TopicInfo],
        wants: Callable[[RawRecord], bool],
        seen: set[tuple[str, int, int]],
        label: str,
    ) -> None:
        async for batch in self.reader.scan(topics, label=label, wants=wants):
            for raw in batch:
                spot = (raw.topic.name, raw.partition, raw.offset)
                if spot in seen:
                    continue
                seen.add(spot)
                index.add(decode_raw(raw))

    async def collect(self, subject: Subject) -> ReplayIndex:
        """Every record about the subject (its task and all its triggers)."""
        topics = await self.reader.topics()
        index = ReplayIndex(prefix=self.settings.topic_prefix)
        seen: set[tuple[str, int, int]] = set()
        tids = {subject.trigger_id} if subject.trigger_id else set()
        keys = {subject.ti_key} if subject.ti_key else set()
        wants = subject_filter(trigger_ids=tids, ti_keys=keys)
        await self._fold(index, topics, wants, seen, "reading")
        more_tids, more_keys = subject_ids(index, subject)
        more_tids -= tids
        more_keys -= keys
        if subject.trigger_id is not None:
            more_tids = set()  # a trigger's timeline shows its task's states, not other triggers
        # One more pass for what the first one linked to: a trigger's tombstones carry only
        # its id (defer topics); a task's states and runs need not name the trigger.
        follow_roles: set[TopicRole] = set()
        if more_tids:
            follow_roles.add(TopicRole.DEFER)
        if more_keys:
            follow_roles.update((TopicRole.TASKS, TopicRole.WORK, TopicRole.RESUMES))
        follow_topics = [t for t in topics if t.role in follow_roles]
        if follow_topics:
            follow = subject_filter(trigger_ids=more_tids, ti_keys=more_keys)
            await self._fold(index, follow_topics, follow, seen, "following links")
        self.index = index
        return index

    async def why(self, subject: Subject) -> tuple[Verdict, list[TimelineEntry]]:
        index = await self.collect(subject)
        verdict = explain(index, subject, await self.context())
        return verdict, build_timeline(index, subject, try_number=subject.try_number)

    async def timeline(self, subject: Subject) -> list[TimelineEntry]:
        index = await self.collect(subject)
        return build_timeline(index, subject, try_number=subject.try_number)

    async def stuck(
        self, *, older_than: dt.timedelta, limit: int | None = None
    ) -> list[StuckReport]:
        """Tasks waiting on a trigger for at least ``older_than``, oldest first, with verdicts.

        ``limit`` keeps the oldest N (and the memory of pass 2 with them); how many wait in
        all is left in :attr:`waiting_total`.
        """
        topics = await self.reader.topics()
        scan = StuckScan()
        task_topics = [t for t in topics if t.role is TopicRole.TASKS]
        async for batch in self.reader.scan(task_topics, label="tasks", wants=_feed(scan)):
            del batch  # the scan keeps what it needs
        waiting = scan.waiting(now=self.now, older_than=older_than)
        self.waiting_total = len(waiting)
        waiting = waiting[:limit] if limit is not None else waiting
        index = ReplayIndex(prefix=self.settings.topic_prefix)
        self.index = index
        if not waiting:
            return []
        tids = {w.trigger_id for w in waiting}
        keys = {w.ti_key for w in waiting}
        wants = _stuck_filter(index, tids, keys)
        seen: set[tuple[str, int, int]] = set()
        await self._fold(index, topics, wants, seen, "related records")
        ctx = await self.context()
        reports = []
        for item in waiting:
            verdict = explain_task(index, item.ti_key, ctx)
            age = self.now - item.since if item.since is not None else None
            reports.append(StuckReport(item, verdict, age))
        return reports


def _feed(scan: StuckScan) -> Callable[[RawRecord], bool]:
    def wants(raw: RawRecord) -> bool:
        scan.feed(raw)
        return False

    return wants


def _stuck_filter(
    index: ReplayIndex, tids: set[str], keys: set[str]
) -> Callable[[RawRecord], bool]:
    """Keep the records of the stuck tasks and triggers; peek at other events for owners."""
    tid_bytes = {t.encode() for t in tids}
    key_bytes = {k.encode() for k in keys}

    def wants(raw: RawRecord) -> bool:
        role = raw.topic.role
        if role is TopicRole.TASKS:
            return raw.key in key_bytes
        if role in (TopicRole.DEFER, TopicRole.RESUME):
            if raw.key in tid_bytes:
                return True
            if role is TopicRole.RESUME and raw.value is not None:
                _observe_owner(index, raw)
            return False
        if raw.value is None:
            return False
        try:
            data = orjson.loads(raw.value)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(data, dict):
            return False
        if data.get("trigger_id") in tids:
            return True
        task = data.get("task")
        if isinstance(task, dict):
            ti_key = "/".join(
                str(task.get(k, d))
                for k, d in (("dag_id", ""), ("task_id", ""), ("run_id", ""), ("map_index", -1))
            )
            return ti_key in keys
        return False

    return wants


def _observe_owner(index: ReplayIndex, raw: RawRecord) -> None:
    assert raw.value is not None
    try:
        data = orjson.loads(raw.value)
    except orjson.JSONDecodeError:
        return
    if not isinstance(data, dict):
        return
    member = data.get("member")
    emitted = _parse_time(data.get("emitted_at"))
    if not isinstance(member, str) or emitted is None:
        return
    partition = data.get("partition")
    queue = data.get("queue", raw.topic.queue)
    index.owners.observe(
        None if queue in (None, "default") else str(queue),
        partition if isinstance(partition, int) else raw.partition,
        member,
        emitted,
    )
