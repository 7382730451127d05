"""The triggerer's Prometheus metrics (names follow Airflow's where Airflow has one).

Airflow's StatsD names map as: ``triggers.running`` → ``deferline_triggers_running``,
``triggerer.capacity_left`` → ``deferline_triggerer_capacity_left``,
``triggers.blocked_main_thread`` → ``deferline_triggers_blocked_main_thread_total``,
``triggers.succeeded`` / ``triggers.failed`` → ``deferline_triggers_succeeded_total`` /
``deferline_triggers_failed_total``. Supervisor figures are read at scrape time, and so are
the membership figures of each queue's lane (the member core's
:class:`~deferline.runners.member.MemberCollector`, under the names in ``MEMBER_METRICS``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..member import MemberCollector, MemberMetricNames

__all__ = ["MEMBER_METRICS", "TriggererMetrics"]

_BOOTSTRAP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# (snapshot key, metric name, help, kind) read from SupervisorMetrics.snapshot()
_SUPERVISOR_FIGURES: tuple[tuple[str, str, str, str], ...] = (
    ("running", "deferline_triggers_running", "Triggers running (coroutines plus timers).", "g"),
    ("waiting_timers", "deferline_triggers_waiting_timers", "Timer triggers in the heap.", "g"),
    ("pending", "deferline_triggers_pending", "Triggers queued for capacity.", "g"),
    ("capacity", "deferline_triggerer_capacity", "Configured trigger capacity.", "g"),
    ("capacity_left", "deferline_triggerer_capacity_left", "Free trigger slots.", "g"),
    ("fired", "deferline_triggers_succeeded", "Trigger events fired.", "c"),
    ("failed", "deferline_triggers_failed", "Triggers that failed.", "c"),
    ("timed_out", "deferline_triggers_timed_out", "Triggers that hit their timeout.", "c"),
    ("cancelled", "deferline_triggers_cancelled", "Triggers cancelled by the runner.", "c"),
    (
        "blocked_loop",
        "deferline_triggers_blocked_main_thread",
        "Episodes of a trigger blocking the event loop.",
        "c",
    ),
    (
        "blocked_seconds",
        "deferline_triggers_blocked_seconds",
        "Seconds the event loop was blocked by triggers.",
        "c",
    ),
    (
        "abandoned",
        "deferline_triggers_abandoned",
        "Triggers that ignored cancellation or hung in cleanup.",
        "c",
    ),
)


# The other families read at scrape time: (name, help).
_FIRE_LAG = (
    "deferline_trigger_fire_lag_seconds",
    "Fire time minus due time of timers and timeouts.",
)
_ACTIVE = (
    "deferline_triggerer_active_triggers",
    "Active triggers in the owned partitions' tables.",
)
_LAG = (
    "deferline_triggerer_consumer_lag",
    "Defer-topic records not yet read (high watermark minus position).",
)
_BACKLOG = (
    "deferline_triggerer_emitter_backlog",
    "Outcomes queued for producing and not yet acked.",
)


MEMBER_METRICS = MemberMetricNames(
    rebalances="deferline_triggerer_rebalances",
    takeovers="deferline_triggerer_takeovers",
    partitions_fenced="deferline_triggerer_partitions_fenced",
    transactions="deferline_triggerer_transactions",
    transactions_fenced="deferline_triggerer_transactions_fenced",
    owned="deferline_triggerer_assigned_partitions",
    owned_help="Defer-topic partitions owned by this member.",
)
"""The triggerer's names of its membership metrics, one series per queue's lane (its
transactions summed over the lanes)."""


def _described() -> list[Metric]:
    """The families :class:`_CallbackCollector` builds, without samples."""
    families: list[Metric] = [
        GaugeMetricFamily(name, doc) if kind == "g" else CounterMetricFamily(name, doc)
        for _, name, doc, kind in _SUPERVISOR_FIGURES
    ]
    families.append(HistogramMetricFamily(*_FIRE_LAG))
    families += [GaugeMetricFamily(*pair) for pair in (_ACTIVE, _LAG, _BACKLOG)]
    return families


class _CallbackCollector(Collector):
    """Builds metric families from live state at scrape time.

    ``describe()`` names them before any source is attached, so the registry knows them: a
    scrape that asks for some series by name (``?name[]=``) finds these too.
    """

    def __init__(self, build: Callable[[], Iterable[Metric]]) -> None:
        self._build = build

    def collect(self) -> Iterator[Metric]:
        yield from self._build()

    def describe(self) -> Iterator[Metric]:
        return iter(_described())


class TriggererMetrics:
    """Every metric of one triggerer process, in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None, *, member: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.info = Gauge(
            "deferline_triggerer_info", "This triggerer process.", ["member"], registry=r
        )
        self.info.labels(member=member).set(1)
        self.members = MemberCollector(MEMBER_METRICS, label="queue")
        """Each queue's lane adds its membership figures here."""
        r.register(self.members)
        self.rebalance_partitions = Counter(
            "deferline_triggerer_rebalance_partitions",
            "Partitions per rebalance outcome: kept (never stopped), acquired (rebuilt here), "
            "lost (moved to another member).",
            ["queue", "outcome"],
            registry=r,
        )
        self.rebalance_triggers = Counter(
            "deferline_triggerer_rebalance_triggers",
            "Triggers per rebalance action: kept running, cancelled (partition lost), "
            "rebuilt (partition acquired).",
            ["queue", "action"],
            registry=r,
        )
        self.partition_pause_seconds = Histogram(
            "deferline_triggerer_partition_pause_seconds",
            "Per partition and rebalance: seconds from revocation until it emitted again "
            "(kept) or followed its tail again (acquired).",
            ["queue"],
            buckets=_BOOTSTRAP_BUCKETS,
            registry=r,
        )
        self.bootstrap_seconds = Histogram(
            "deferline_triggerer_bootstrap_seconds",
            "Time from assignment until every folded trigger of the partitions is started.",
            ["queue"],
            buckets=_BOOTSTRAP_BUCKETS,
            registry=r,
        )
        self.bootstrap_records = Counter(
            "deferline_triggerer_bootstrap_records",
            "Records read while rebuilding active sets (topic=defer|resume).",
            ["queue", "topic"],
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "deferline_triggerer_checkpoint_seconds",
            "Time to write one partition checkpoint.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=r,
        )
        self.checkpoint_mismatches = Counter(
            "deferline_triggerer_checkpoint_mismatches",
            "Partition checkpoints discarded because they were read from another log.",
            registry=r,
        )
        self.checkpoint_failures = Counter(
            "deferline_triggerer_checkpoint_failures",
            "Checkpoint store calls that failed (action=write|discard|release); the lane goes "
            "on, and the partition is rebuilt from the topics when its checkpoint is unusable.",
            ["action"],
            registry=r,
        )
        self.deferrals = Counter(
            "deferline_triggerer_deferrals",
            "DeferRequests read from the defer topics.",
            ["queue"],
            registry=r,
        )
        self.cancel_requests = Counter(
            "deferline_triggerer_cancel_requests",
            "CancelRequests read from the defer topics.",
            ["queue"],
            registry=r,
        )
        self.events = Counter(
            "deferline_triggerer_events",
            "Trigger events produced (acked) to the resume topics.",
            ["queue", "status"],
            registry=r,
        )
        self.direct_resumes = Counter(
            "deferline_triggerer_direct_resumes",
            "RunTask(mode=resume) records produced directly (--direct-resume).",
            ["queue"],
            registry=r,
        )
        self.dead_letters = Counter(
            "deferline_triggerer_dead_letters",
            "Records sent to the dead-letter topic.",
            ["queue", "reason"],
            registry=r,
        )
        self.extra_events_dropped = Counter(
            "deferline_triggerer_extra_events_dropped",
            "Later events of a trigger that had already emitted (the task resumed on the first).",
            registry=r,
        )
        self.trigger_log_lines = Counter(
            "deferline_triggerer_trigger_log_lines",
            "Log lines of triggers shipped to the trigger.logs topic (--trigger-logs).",
            registry=r,
        )
        self.trigger_log_lines_dropped = Counter(
            "deferline_triggerer_trigger_log_lines_dropped",
            "Log lines of triggers dropped: more were waiting to be shipped than the bound.",
            registry=r,
        )
        self.watch_runs = Counter(
            "deferline_triggerer_watch_runs",
            "Runs of standing watches started, by why (first: the watch's first run here; "
            "ended: after a run that returned; failed: after a run that failed, with backoff).",
            ["queue", "reason"],
            registry=r,
        )
        self.watch_events_dropped = Counter(
            "deferline_triggerer_watch_events_dropped",
            "Events of standing watches not published because their partition was lost or "
            "released while they were produced (their source gave them up already).",
            ["queue"],
            registry=r,
        )
        self.fetch_paused = Gauge(
            "deferline_triggerer_fetch_paused",
            "1 while fetching is paused for backpressure.",
            ["queue"],
            registry=r,
        )
        self._supervisor: Callable[[], Mapping[str, float]] | None = None
        self._fire_lag: Callable[[], Any] | None = None
        self._partitions: Callable[[], Iterable[tuple[str, int, int, int]]] | None = None
        self._backlog: Callable[[], int] | None = None
        r.register(_CallbackCollector(self._collect))

    def watch(
        self,
        *,
        supervisor: Callable[[], Mapping[str, float]],
        fire_lag: Callable[[], Any] | None = None,
        partitions: Callable[[], Iterable[tuple[str, int, int, int]]],
        backlog: Callable[[], int],
    ) -> None:
        """Attach the live sources read at scrape time.

        ``partitions`` yields ``(queue, partition, active_triggers, consumer_lag)``.
        """
        self._supervisor = supervisor
        self._fire_lag = fire_lag
        self._partitions = partitions
        self._backlog = backlog

    def _collect(self) -> Iterator[Metric]:
        if self._supervisor is not None:
            snapshot = self._supervisor()
            for key, name, doc, kind in _SUPERVISOR_FIGURES:
                value = float(snapshot.get(key, 0))
                if kind == "g":
                    yield GaugeMetricFamily(name, doc, value=value)
                else:
                    yield CounterMetricFamily(name, doc, value=value)
        if self._fire_lag is not None:
            lag = self._fire_lag()
            if lag is not None:
                buckets = [
                    ("+Inf" if bound == float("inf") else repr(bound), count)
                    for bound, count in lag.cumulative()
                ]
                yield HistogramMetricFamily(*_FIRE_LAG, buckets=buckets, sum_value=lag.sum)
        if self._partitions is not None:
            active = GaugeMetricFamily(*_ACTIVE, labels=["queue", "partition"])
            lag_family = GaugeMetricFamily(*_LAG, labels=["queue", "partition"])
            for queue, partition, size, lag_records in self._partitions():
                active.add_metric([queue, str(partition)], size)
                lag_family.add_metric([queue, str(partition)], lag_records)
            yield active
            yield lag_family
        if self._backlog is not None:
            yield GaugeMetricFamily(*_BACKLOG, value=self._backlog())
