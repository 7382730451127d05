"""Which deferline topic a topic name is: its role and its queue."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["TopicInfo", "TopicRole", "classify_topic"]

_QUEUE = re.compile(r"^[A-Za-z0-9_\-]+$")


class TopicRole(StrEnum):
    """What a topic carries."""

    DEFER = "defer"  # DeferRequest / CancelRequest / tombstones, key = trigger id
    RESUME = "resume"  # TriggerEventRecord, key = trigger id
    TASKS = "tasks"  # TaskStateRecord, key = task instance
    TASK_EVENTS = "tasks.events"  # TriggerEventRecord copied from RESUME, key = task instance
    WORK = "work"  # RunTask(mode="start")
    RESUMES = "resumes"  # RunTask(mode="resume")
    DEAD = "dead"  # DeadLetter


@dataclass(frozen=True, slots=True)
class TopicInfo:
    """A topic name with its role and queue (trigger queue or worker queue; None = default)."""

    name: str
    role: TopicRole
    queue: str | None = None


def classify_topic(name: str, *, prefix: str) -> TopicInfo | None:
    """Role of ``name`` under ``prefix``, or None when it is not a deferline topic.

    ``queue.resumes`` is the resume topic of the default worker queue (a worker queue named
    ``resumes`` would be ambiguous, and is read as that).
    """
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    head, _, tail = rest.partition(".")
    if head == "tasks" and tail == "events":
        return TopicInfo(name, TopicRole.TASK_EVENTS)
    if head in ("tasks", "dead"):
        return TopicInfo(name, TopicRole(head)) if not tail else None
    if head in ("defer", "resume"):
        if not tail:
            return TopicInfo(name, TopicRole(head))
        return TopicInfo(name, TopicRole(head), tail) if _QUEUE.match(tail) else None
    if head == "queue":
        if not tail:
            return TopicInfo(name, TopicRole.WORK)
        if tail == "resumes":
            return TopicInfo(name, TopicRole.RESUMES)
        queue, _, suffix = tail.partition(".")
        if not _QUEUE.match(queue):
            return None
        if not suffix:
            return TopicInfo(name, TopicRole.WORK, queue)
        return TopicInfo(name, TopicRole.RESUMES, queue) if suffix == "resumes" else None
    return None
