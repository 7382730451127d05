"""Topic specs: partitions and configs of every topic deferline needs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ._names import TopicNames
from ._settings import Settings

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS

# Compacted tables (defer, tasks): the latest value per key, tombstones for finished keys.
# Records stay uncompacted for an hour so replay can still see recent history; tombstones
# live a day so a lagging reader still learns that a key was deleted; hourly segments make
# compaction actually happen on quiet topics (only closed segments are cleaned).
COMPACTED: dict[str, str] = {
    "cleanup.policy": "compact",
    "min.compaction.lag.ms": str(HOUR_MS),
    "delete.retention.ms": str(DAY_MS),
    "segment.ms": str(HOUR_MS),
}
# Event streams (resume, tasks.events, queues): kept a week, enough for replay and diagnosis.
EVENTS: dict[str, str] = {"cleanup.policy": "delete", "retention.ms": str(7 * DAY_MS)}
# Dead letters wait a month for a human.
DEAD: dict[str, str] = {"cleanup.policy": "delete", "retention.ms": str(30 * DAY_MS)}
# Trigger log lines on their way to the Airflow bridge's log files: a day is plenty.
LOGS: dict[str, str] = {"cleanup.policy": "delete", "retention.ms": str(DAY_MS)}


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """What a topic should look like when deferline creates it."""

    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str] = field(default_factory=dict)


def trigger_logs_spec(settings: Settings) -> TopicSpec:
    """The ``trigger.logs`` topic, made by the triggerers that write it and the bridges that
    read it (``--trigger-logs``), not by :func:`topic_specs`: other deployments have none."""
    rf = settings.replication_factor
    durable = {"min.insync.replicas": "2"} if rf >= 3 else {}
    name = TopicNames(settings.topic_prefix).trigger_logs
    return TopicSpec(name, settings.partitions, rf, {**LOGS, **durable})


def topic_specs(
    settings: Settings,
    queues: Iterable[str | None] = (),
    worker_queues: Iterable[str] = (),
) -> list[TopicSpec]:
    """Specs for the default topics plus each trigger queue and worker queue.

    Every ``defer.<q>``/``resume.<q>`` pair gets the same partition count, so a trigger id
    hashes to the same partition number in both (co-partitioning); so do ``tasks`` and
    ``tasks.events``, for a task key (ensure_topics matches a new one to an existing partner).
    """
    names = TopicNames(settings.topic_prefix)
    n, rf = settings.partitions, settings.replication_factor
    specs: dict[str, TopicSpec] = {}

    # With three replicas, an acks=all write is on two of them before it is acknowledged:
    # losing one broker loses no acknowledged record and keeps the topic writable.
    durable = {"min.insync.replicas": "2"} if rf >= 3 else {}

    def add(name: str, config: dict[str, str]) -> None:
        specs.setdefault(name, TopicSpec(name, n, rf, {**config, **durable}))

    for queue in (None, *queues):
        add(names.defer(queue), COMPACTED)
        add(names.resume(queue), EVENTS)
    add(names.tasks, COMPACTED)
    add(names.task_events, EVENTS)
    for worker_queue in ("default", *worker_queues):
        add(names.work(worker_queue), EVENTS)
        add(names.resumes(worker_queue), EVENTS)
    add(names.dead, DEAD)
    # One partition: the ledger's order is the topic's order (the ledger owner reads every
    # want in the order the partition owners wrote them, and grants in that order).
    pools = names.scheduler_pools
    specs.setdefault(pools, TopicSpec(pools, 1, rf, {**COMPACTED, **durable}))
    return list(specs.values())
