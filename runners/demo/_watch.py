"""Watching the tasks and resume topics: what the live view and the summary show."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Sequence

from aiokafka import TopicPartition
from deferline.engine import progress
from deferline.schemas import SchemaError, TaskStateRecord, TriggerEventRecord, decode
from deferline.topics import Settings, TopicNames, make_consumer, start_client, stop_client

from ._plan import KINDS, TaskSpec

__all__ = ["FINAL_STATES", "STATE_ORDER", "Watch", "watch_topics"]


FINAL_STATES = frozenset({"success", "failed", "skipped", "removed"})
STATE_ORDER = ("scheduled", "queued", "running", "deferred", "up_for_retry", *sorted(FINAL_STATES))


class Watch:
    """Folds the tasks and resume topics into what the live view and the summary show."""

    def __init__(self, specs: Sequence[TaskSpec], dag_id: str) -> None:
        self.kind_of = {f"{dag_id}/{s.name}/run/-1": s.kind for s in specs}
        self.expect = {f"{dag_id}/{s.name}/run/-1": s.expect for s in specs}
        self.state: dict[str, TaskStateRecord] = {}
        self._at: dict[str, tuple[int, int, int]] = {}
        self._running_since: dict[str, dt.datetime] = {}
        self._first: dict[str, dt.datetime] = {}
        self.slot_seconds = 0.0
        self.blocking_seconds = 0.0
        self.deferred_now = 0
        self.deferred_peak = 0
        self.events: Counter[str] = Counter()
        self.events_by_member: Counter[str] = Counter()

    def fold_task(self, record: TaskStateRecord) -> None:
        key = record.task.ti_key
        if key not in self.kind_of:
            return
        at = progress(record)
        if at <= self._at.get(key, (-1, -1, -1)):
            return
        previous = self.state.get(key)
        self._at[key] = at
        self.state[key] = record
        self._first.setdefault(key, record.updated_at)
        if previous is not None and previous.state == "deferred":
            self.deferred_now -= 1
        if record.state == "deferred":
            self.deferred_now += 1
            self.deferred_peak = max(self.deferred_peak, self.deferred_now)
        if record.state == "running":
            self._running_since[key] = record.updated_at
            self._first[key] = min(self._first[key], record.updated_at)
        elif record.source == "worker" and key in self._running_since:
            since = self._running_since.pop(key)
            self.slot_seconds += max(0.0, (record.updated_at - since).total_seconds())
        if record.state in FINAL_STATES:
            self._running_since.pop(key, None)
            self.blocking_seconds += max(
                0.0, (record.updated_at - self._first[key]).total_seconds()
            )

    def fold_event(self, record: TriggerEventRecord) -> None:
        self.events[record.status] += 1
        if record.member is not None:
            self.events_by_member[record.member] += 1

    def by_state(self) -> Counter[str]:
        counts: Counter[str] = Counter(r.state for r in self.state.values())
        counts["scheduled"] += len(self.kind_of) - len(self.state)
        return counts

    def finished(self) -> set[str]:
        return {key for key, r in self.state.items() if r.state in FINAL_STATES}

    def done_names(self) -> set[str]:
        return {key.split("/")[1] for key in self.finished()}

    def by_kind(self) -> dict[str, tuple[int, int]]:
        totals: Counter[str] = Counter(self.kind_of.values())
        done: Counter[str] = Counter(self.kind_of[k] for k in self.finished())
        return {kind: (done[kind], totals[kind]) for kind, _, _ in KINDS if totals[kind]}

    def unexpected(self) -> list[str]:
        return sorted(
            key
            for key, record in self.state.items()
            if record.state in FINAL_STATES and record.state != self.expect[key]
        )


async def watch_topics(settings: Settings, watch: Watch) -> None:
    """Read the tasks and resume topics from the start into ``watch`` (runs until cancelled)."""
    names = TopicNames(settings.topic_prefix)
    consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=20)
    try:
        await start_client(consumer, grace=5.0, name="demo watcher")
        tps: list[TopicPartition] = []
        for topic in (names.tasks, names.resume()):
            partitions = None
            for _ in range(100):
                partitions = consumer.partitions_for_topic(topic)
                if partitions:
                    break
                await consumer._client.force_metadata_update()
            tps += [TopicPartition(topic, p) for p in sorted(partitions or ())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        while True:
            batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            for messages in batches.values():
                for message in messages:
                    if message.value is None:
                        continue
                    try:
                        record = decode(message.value)
                    except SchemaError:
                        continue
                    if isinstance(record, TaskStateRecord):
                        watch.fold_task(record)
                    elif isinstance(record, TriggerEventRecord):
                        watch.fold_event(record)
    finally:
        await stop_client(consumer, grace=5.0, name="demo watcher")
