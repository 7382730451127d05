"""What a local checkpoint was read from, and whether that is the log a runner reads now.

A checkpoint caches a particular log. Offsets alone do not name one: a recreated cluster, or
a topic deleted and created again under the same name, can have offsets in the same range.
Kafka names a log by the cluster id and each topic's id (a UUID per topic incarnation, in
Metadata v10+), plus the partition count; deferline adds the topic prefix and the consumer
group the positions belong to. No I/O here: :func:`deferline.topics.read_log_identity` asks
the broker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["IdentityMismatch", "LogIdentity", "TopicIdentity", "compare_identity"]


@dataclass(frozen=True, slots=True)
class TopicIdentity:
    """One topic as the broker names it. ``topic_id`` is None where the broker gives none."""

    name: str
    topic_id: str | None
    partitions: int


@dataclass(frozen=True, slots=True)
class LogIdentity:
    """The log a checkpoint reflects: cluster, topics (sorted by name), prefix and group."""

    cluster_id: str | None
    topics: tuple[TopicIdentity, ...]
    prefix: str
    group: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (stored in a checkpoint's header)."""
        return {
            "cluster_id": self.cluster_id,
            "topics": [[t.name, t.topic_id, t.partitions] for t in self.topics],
            "prefix": self.prefix,
            "group": self.group,
        }

    @classmethod
    def from_json(cls, data: Any) -> LogIdentity:
        """The inverse of :meth:`to_json`; KeyError, TypeError or ValueError if malformed."""
        return cls(
            cluster_id=None if data["cluster_id"] is None else str(data["cluster_id"]),
            topics=tuple(
                TopicIdentity(str(name), None if tid is None else str(tid), int(count))
                for name, tid, count in data["topics"]
            ),
            prefix=str(data["prefix"]),
            group=str(data["group"]),
        )


@dataclass(frozen=True, slots=True)
class IdentityMismatch:
    """How a checkpoint's identity differs from the log's: ``what``, expected and found."""

    what: str
    expected: str
    found: str

    def __str__(self) -> str:
        return f"{self.what}: expected {self.expected}, found {self.found}"


def compare_identity(expected: LogIdentity, found: LogIdentity | None) -> IdentityMismatch | None:
    """The first difference between the log read now (``expected``) and the identity a
    checkpoint records (``found``; None: it records none), or None when they name one log.

    A topic id that one side lacks is a difference: a checkpoint written where the broker
    gave no ids is not trusted by a broker that gives them, nor the other way round.
    """
    if found is None:
        return IdentityMismatch("identity", _log_text(expected), "none recorded")
    for what, want, got in (
        ("topic prefix", expected.prefix, found.prefix),
        ("group", expected.group, found.group),
        ("cluster id", expected.cluster_id, found.cluster_id),
    ):
        if want != got:
            return IdentityMismatch(what, _text(want), _text(got))
    names = [t.name for t in expected.topics]
    found_names = [t.name for t in found.topics]
    if names != found_names:
        return IdentityMismatch("topics", ", ".join(names), ", ".join(found_names))
    for want_topic, got_topic in zip(expected.topics, found.topics, strict=True):
        if want_topic.topic_id != got_topic.topic_id:
            return IdentityMismatch(
                f"topic id of {want_topic.name}",
                _text(want_topic.topic_id),
                _text(got_topic.topic_id),
            )
        if want_topic.partitions != got_topic.partitions:
            return IdentityMismatch(
                f"partition count of {want_topic.name}",
                str(want_topic.partitions),
                str(got_topic.partitions),
            )
    return None


def _text(value: str | None) -> str:
    return "none" if value is None else value


def _log_text(identity: LogIdentity) -> str:
    return f"cluster {_text(identity.cluster_id)}, " + ", ".join(
        f"{t.name} {_text(t.topic_id)}" for t in identity.topics
    )
