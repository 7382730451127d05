"""Prometheus figures of the scheduler, read from its table at scrape time.

Its membership figures (rebalances, takeovers, fenced partitions, owned partitions,
transactions) are read by the member core's collector
(:class:`~deferline.runners.member.MemberCollector`), under the names in ``MEMBER_METRICS``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..member import MemberMetricNames

if TYPE_CHECKING:
    from deferline.engine import TaskTable

    from ._housekeeping import Housekeeping
    from ._pools import PoolChannel
    from ._standby import Standby
    from ._writers import PartitionWriters

__all__ = ["MEMBER_METRICS", "SchedulerCollector", "SchedulerFigures", "pool_ledger_metrics"]

MEMBER_METRICS = MemberMetricNames(
    rebalances="deferline_scheduler_rebalances",
    takeovers="deferline_scheduler_takeovers",
    partitions_fenced="deferline_scheduler_partitions_fenced",
    transactions="deferline_scheduler_transactions",
    transactions_fenced="deferline_scheduler_transactions_fenced",
    owned="deferline_scheduler_partitions_owned",
    owned_help="Task partitions (of tasks and tasks.events) this scheduler owns and writes for.",
)
"""The scheduler's names of its membership metrics."""


class SchedulerFigures(Protocol):
    """What the collector reads from a scheduler at scrape time."""

    @property
    def table(self) -> TaskTable: ...
    @property
    def active(self) -> bool: ...
    @property
    def bad_records(self) -> int: ...
    @property
    def checkpoint_mismatches(self) -> int: ...
    @property
    def housekeeping(self) -> Housekeeping: ...
    @property
    def writers(self) -> PartitionWriters: ...
    @property
    def standby(self) -> Standby | None: ...
    @property
    def pool_channel(self) -> PoolChannel | None: ...


class SchedulerCollector(Collector):
    """Scheduler figures, read from the table at scrape time."""

    def __init__(self, scheduler: SchedulerFigures) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        table = self.scheduler.table
        c = table.counters
        events = CounterMetricFamily(
            "deferline_scheduler_events",
            "Trigger events read, by what the scheduler did with them.",
            labels=["verdict"],
        )
        for verdict, value in (
            ("applied", c.events_applied),
            ("duplicate", c.events_duplicate),
            ("direct", c.events_direct),
            ("cancelled", c.events_cancelled),
            ("orphaned", c.events_orphaned),
        ):
            events.add_metric([verdict], value)
        yield events
        yield _counter(
            "deferline_scheduler_duplicates_dropped",
            "Duplicate or stale events dropped.",
            c.events_duplicate,
        )
        enqueued = CounterMetricFamily(
            "deferline_scheduler_runs_enqueued", "RunTasks sent to workers.", labels=["mode"]
        )
        enqueued.add_metric(["start"], c.starts)
        enqueued.add_metric(["resume"], c.resumes)
        yield enqueued
        yield _counter(
            "deferline_scheduler_runs_resent",
            "Resume RunTasks sent again after a takeover without transactions.",
            c.resends,
        )
        yield _counter(
            "deferline_scheduler_ended_by_trigger",
            "Tasks ended by their trigger.",
            c.ended_by_trigger,
        )
        yield _counter("deferline_scheduler_retries", "Retries scheduled.", c.retries)
        yield _counter("deferline_scheduler_cancels", "CancelRequests sent.", c.cancels)
        yield _counter(
            "deferline_scheduler_stale_states",
            "Task records behind the current state.",
            c.states_stale,
        )
        yield _counter(
            "deferline_scheduler_repairs",
            "Task states re-published over a stale record.",
            c.repairs,
        )
        yield _counter(
            "deferline_scheduler_bad_records",
            "Unreadable records skipped.",
            self.scheduler.bad_records,
        )
        yield _counter(
            "deferline_scheduler_checkpoint_mismatches",
            "Checkpoints discarded because they were read from another log.",
            self.scheduler.checkpoint_mismatches,
        )
        used = GaugeMetricFamily(
            "deferline_scheduler_pool_slots_used", "Pool slots held.", labels=["pool"]
        )
        size = GaugeMetricFamily(
            "deferline_scheduler_pool_slots", "Pool size (absent: unlimited).", labels=["pool"]
        )
        for pool, (in_use, total) in table.pool_usage().items():
            used.add_metric([pool], in_use)
            if total is not None:
                size.add_metric([pool], total)
        yield used
        yield size
        states = GaugeMetricFamily(
            "deferline_scheduler_tasks", "Task instances by state.", labels=["state"]
        )
        for state, count in sorted(table.count_by_state().items()):
            states.add_metric([state], count)
        yield states
        yield GaugeMetricFamily(
            "deferline_scheduler_overdue_deferrals",
            "Deferred tasks whose deferral's timeout has passed.",
            value=table.overdue_deferrals(dt.datetime.now(dt.UTC)),
        )
        yield GaugeMetricFamily(
            "deferline_scheduler_pending_events",
            "Events held until their deferral is read.",
            value=table.pending_events,
        )
        yield GaugeMetricFamily(
            "deferline_scheduler_active",
            "1 while this scheduler owns task partitions and writes for them, else 0.",
            value=1 if self.scheduler.active else 0,
        )
        housekeeping = self.scheduler.housekeeping
        lag = GaugeMetricFamily(
            "deferline_scheduler_lag", "Records not yet read, per input.", labels=["input"]
        )
        for name, value in sorted(housekeeping.lag.items()):
            lag.add_metric([name], value)
        yield lag
        partition_lag = GaugeMetricFamily(
            "deferline_scheduler_partition_lag",
            "Events on tasks.events not yet folded, per partition this scheduler owns.",
            labels=["partition"],
        )
        for partition, value in sorted(housekeeping.events_lag.items()):
            partition_lag.add_metric([str(partition)], value)
        yield partition_lag
        per_partition = CounterMetricFamily(
            "deferline_scheduler_partition_events",
            "Trigger events read per owned partition (since it was acquired), by verdict.",
            labels=["partition", "verdict"],
        )
        for partition, (applied, duplicate) in self.scheduler.writers.counts().items():
            per_partition.add_metric([str(partition), "applied"], applied)
            per_partition.add_metric([str(partition), "duplicate"], duplicate)
        yield per_partition
        standby = self.scheduler.standby
        if standby is not None:
            yield GaugeMetricFamily(
                "deferline_scheduler_standby_partitions",
                "Task partitions another scheduler owns, kept folded here (--standby).",
                value=len(standby.partitions),
            )
            yield GaugeMetricFamily(
                "deferline_scheduler_standby_tasks",
                "Tasks in the standby tables.",
                value=standby.tasks,
            )
            yield _counter(
                "deferline_scheduler_standby_records",
                "Tasks-topic records folded into the standby tables.",
                standby.records,
            )
            yield _counter(
                "deferline_scheduler_standby_handovers",
                "Partitions acquired from a standby table (only their tail folded).",
                standby.handed,
            )
        channel = self.scheduler.pool_channel
        if channel is not None:
            yield from pool_ledger_metrics(channel)


def pool_ledger_metrics(channel: PoolChannel) -> Iterator[Metric]:
    """Pools shared across schedulers, as this scheduler reads the pool ledger: slots granted
    and size per limited pool, wants waiting, and whether this scheduler is the ledger owner
    (the owner's figures are the ledger's own; the others' lag by their read of the topic)."""
    used = GaugeMetricFamily(
        "deferline_scheduler_pool_ledger_slots_used",
        "Pool slots granted by the pool ledger, across every scheduler.",
        labels=["pool"],
    )
    size = GaugeMetricFamily(
        "deferline_scheduler_pool_ledger_slots",
        "Pool size the ledger grants within (absent: unlimited).",
        labels=["pool"],
    )
    for pool, (granted, total) in channel.usage().items():
        used.add_metric([pool], granted)
        if total is not None:
            size.add_metric([pool], total)
    yield used
    yield size
    waiting = GaugeMetricFamily(
        "deferline_scheduler_pool_wants_waiting",
        "Tasks waiting for a slot of a limited pool (wants without a grant), across schedulers.",
        labels=["pool"],
    )
    for pool, count in sorted(channel.waiting().items()):
        waiting.add_metric([pool], count)
    yield waiting
    yield GaugeMetricFamily(
        "deferline_scheduler_pool_ledger_owner",
        "1 while this scheduler owns task partition 0 and so grants pool slots, else 0.",
        value=1 if channel.leading else 0,
    )
    yield _counter(
        "deferline_scheduler_pool_bad_records",
        "Unreadable records of the pools topic skipped.",
        channel.bad_records,
    )


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
