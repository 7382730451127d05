"""Topic names: one place that turns a prefix and queue names into topic names."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._errors import InvalidQueueName

DEFAULT_QUEUE = "default"
_QUEUE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
# A worker queue called "resumes" would make ``work("resumes")`` equal ``resumes()``.
_RESERVED_WORKER_QUEUES = frozenset({"resumes"})


def validate_queue_name(name: str, *, worker: bool = False) -> str:
    """Return ``name`` if it may appear in a topic name, else raise InvalidQueueName."""
    if not isinstance(name, str) or not _QUEUE.match(name):
        raise InvalidQueueName(
            f"queue name {name!r} is invalid: use 1-64 letters, digits, '_' or '-'"
        )
    if worker and name in _RESERVED_WORKER_QUEUES:
        raise InvalidQueueName(f"worker queue name {name!r} is reserved")
    return name


@dataclass(frozen=True, slots=True)
class TopicNames:
    """Names of deferline's topics under ``prefix``.

    The default trigger queue (``None`` or ``"default"``) and the default worker queue
    (``"default"``) have no suffix: ``defer``, ``resume``, ``queue``, ``queue.resumes``.
    """

    prefix: str = "deferline."

    def defer(self, queue: str | None = None) -> str:
        """The compacted DeferRequest/CancelRequest table of a trigger queue (key=trigger id)."""
        return self._trigger_topic("defer", queue)

    def resume(self, queue: str | None = None) -> str:
        """The events topic of a trigger queue, co-partitioned with ``defer(queue)``."""
        return self._trigger_topic("resume", queue)

    @property
    def tasks(self) -> str:
        """The compacted task-state changelog (key=TaskKey.ti_key)."""
        return f"{self.prefix}tasks"

    @property
    def task_events(self) -> str:
        """Every trigger queue's events again, keyed by ``TaskKey.ti_key`` and co-partitioned
        with ``tasks``: the scheduler that owns a task partition reads its events here."""
        return f"{self.prefix}tasks.events"

    def work(self, worker_queue: str = DEFAULT_QUEUE) -> str:
        """RunTask(mode="start") records for a worker queue."""
        return self._worker_topic(worker_queue)

    def resumes(self, worker_queue: str = DEFAULT_QUEUE) -> str:
        """RunTask(mode="resume") records for a worker queue, consumed ahead of ``work``."""
        return f"{self._worker_topic(worker_queue)}.resumes"

    @property
    def scheduler_pools(self) -> str:
        """One partition, compacted: the pool ledger (``want/<ti_key>`` and ``grant/<ti_key>``)
        through which schedulers owning different task partitions share pool slots exactly."""
        return f"{self.prefix}scheduler.pools"

    @property
    def trigger_logs(self) -> str:
        """TriggerLogRecords: the log lines of running triggers, keyed by trigger id, for the
        Airflow bridge to show in Airflow's UI (written with ``--trigger-logs``)."""
        return f"{self.prefix}trigger.logs"

    @property
    def dead(self) -> str:
        """DeadLetter records: messages that could not be processed."""
        return f"{self.prefix}dead"

    def partner(self, topic: str) -> str | None:
        """The co-partitioned partner of a topic name (defer and resume of one trigger queue;
        tasks and tasks.events), else None."""
        if not topic.startswith(self.prefix):
            return None
        rest = topic[len(self.prefix) :]
        if rest in ("tasks", "tasks.events"):
            return self.task_events if rest == "tasks" else self.tasks
        for this, other in (("defer", "resume"), ("resume", "defer")):
            if rest == this:
                return f"{self.prefix}{other}"
            if rest.startswith(this + ".") and _QUEUE.match(rest[len(this) + 1 :]):
                return f"{self.prefix}{other}.{rest[len(this) + 1 :]}"
        return None

    def _trigger_topic(self, base: str, queue: str | None) -> str:
        if queue is None or queue == DEFAULT_QUEUE:
            return f"{self.prefix}{base}"
        return f"{self.prefix}{base}.{validate_queue_name(queue)}"

    def _worker_topic(self, worker_queue: str) -> str:
        if worker_queue == DEFAULT_QUEUE:
            return f"{self.prefix}queue"
        return f"{self.prefix}queue.{validate_queue_name(worker_queue, worker=True)}"
