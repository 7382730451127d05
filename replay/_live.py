"""What the cluster says now: consumer groups, their members, assignments and committed offsets.

The topics record which member ran a trigger (events and dead letters carry ``member`` and
``partition``) but not who is alive now; that comes from the group coordinator. Brokers that do
not report member assignments (Tansu) still report members and committed offsets, so a group
is tied to a topic by its members' assignment or subscription when reported, else by its
committed offsets, else by its name (``GroupHints``).
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition
from deferline.topics import Settings, make_admin, start_client

from ._topics import TopicInfo, TopicRole

__all__ = ["GroupHints", "GroupView", "LiveView", "MemberView", "read_live_view"]

logger = logging.getLogger(__name__)

TopicPartitionKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class GroupHints:
    """Names of the groups expected to consume each role's topics (used when nothing else says).

    Defaults follow the processes: ``<prefix>triggerer[.<queue>]``, ``<prefix>scheduler``,
    ``<prefix>worker.<worker queue>``.
    """

    triggerer: tuple[str, ...] = ()
    scheduler: tuple[str, ...] = ()
    worker: tuple[str, ...] = ()

    @classmethod
    def for_prefix(cls, prefix: str) -> GroupHints:
        return cls(
            triggerer=(f"{prefix}triggerer",),
            scheduler=(f"{prefix}scheduler",),
            worker=(f"{prefix}worker",),
        )

    def names_for(self, role: TopicRole) -> tuple[str, ...]:
        if role is TopicRole.DEFER:
            return self.triggerer
        if role in (TopicRole.TASK_EVENTS, TopicRole.TASKS):
            return self.scheduler
        if role in (TopicRole.WORK, TopicRole.RESUMES):
            return self.worker
        return ()

    def matches(self, group_id: str, role: TopicRole, queue: str | None) -> bool:
        """Is ``group_id`` the hinted group of this role and queue?

        Per-queue groups are ``<name>.<queue>`` (the default queue: ``<name>`` or
        ``<name>.default``); the scheduler's one group reads tasks.events.
        """
        names = self.names_for(role)
        if role in (TopicRole.TASK_EVENTS, TopicRole.TASKS):
            return group_id in names
        for name in names:
            if queue is None and group_id in (name, f"{name}.default", f"{name}-default"):
                return True
            if queue is not None and group_id in (f"{name}.{queue}", f"{name}-{queue}"):
                return True
        return False

    def expected(self, topics: Iterable[TopicInfo]) -> list[str]:
        """The group names the processes would use for these topics."""
        names: set[str] = set(self.scheduler)
        for topic in topics:
            if topic.role is TopicRole.DEFER:
                for name in self.triggerer:
                    names.add(f"{name}.{topic.queue}" if topic.queue else name)
            elif topic.role in (TopicRole.WORK, TopicRole.RESUMES):
                for name in self.worker:
                    names.add(f"{name}.{topic.queue or 'default'}")
        return sorted(names)

    def is_role(self, group_id: str, role: TopicRole) -> bool:
        """Is ``group_id`` a hinted group of the role, for any queue?"""
        return any(
            group_id == name or group_id.startswith((f"{name}.", f"{name}-"))
            for name in self.names_for(role)
        )


@dataclass(frozen=True, slots=True)
class MemberView:
    """One live member of a consumer group."""

    member_id: str
    client_id: str = ""
    host: str = ""
    subscription: tuple[str, ...] = ()
    assignment: tuple[TopicPartitionKey, ...] = ()


@dataclass(frozen=True, slots=True)
class GroupView:
    """One consumer group as the coordinator describes it now."""

    group_id: str
    state: str
    members: tuple[MemberView, ...] = ()
    committed: Mapping[TopicPartitionKey, int] = field(default_factory=dict)

    @property
    def assignments_known(self) -> bool:
        return any(m.assignment or m.subscription for m in self.members)

    def reads(self, topic: str) -> bool:
        """Members subscribe to or are assigned the topic, or the group committed on it."""
        for member in self.members:
            if topic in member.subscription or any(t == topic for t, _ in member.assignment):
                return True
        return any(t == topic for t, _ in self.committed)

    def owners(self, topic: str, partition: int) -> list[MemberView]:
        return [m for m in self.members if (topic, partition) in m.assignment]


@dataclass(frozen=True, slots=True)
class LiveView:
    """A snapshot of the groups and end offsets at ``taken_at``."""

    taken_at: dt.datetime
    groups: tuple[GroupView, ...] = ()
    topics: tuple[TopicInfo, ...] = ()
    end_offsets: Mapping[TopicPartitionKey, int] = field(default_factory=dict)
    hints: GroupHints = field(default_factory=GroupHints)
    errors: tuple[str, ...] = ()

    def groups_for(self, topic: TopicInfo) -> list[tuple[GroupView, str]]:
        """Groups that consume ``topic``, each with how that is known."""
        found: list[tuple[GroupView, str]] = []
        for group in self.groups:
            if group.reads(topic.name):
                how = "assignment" if group.assignments_known else "committed offsets"
                found.append((group, how))
            elif not group.assignments_known and self.hints.matches(
                group.group_id, topic.role, topic.queue
            ):
                found.append((group, "group name"))
        return found

    def groups_for_role(self, role: TopicRole) -> list[GroupView]:
        """Groups that consume any known topic of the role (by assignment, commits or name)."""
        found: dict[str, GroupView] = {}
        for topic in self.topics:
            if topic.role is role:
                for group, _ in self.groups_for(topic):
                    found.setdefault(group.group_id, group)
        for group in self.groups:
            if self.hints.is_role(group.group_id, role):
                found.setdefault(group.group_id, group)
        return list(found.values())

    def committed(self, group: GroupView, topic: str, partition: int) -> int | None:
        offset = group.committed.get((topic, partition))
        return offset if offset is not None and offset >= 0 else None

    def end_offset(self, topic: str, partition: int) -> int | None:
        return self.end_offsets.get((topic, partition))


def _ours(group_id: str, prefix: str, hints: GroupHints) -> bool:
    """Named with the topic prefix (as every deferline process names its group) or hinted."""
    if group_id.startswith(prefix):
        return True
    names = {*hints.triggerer, *hints.scheduler, *hints.worker}
    return any(group_id == n or group_id.startswith((f"{n}.", f"{n}-")) for n in names)


async def _describe(admin: Any, group_id: str, tps: list[TopicPartition]) -> GroupView:
    described = await admin.describe_consumer_groups([group_id])
    members: list[MemberView] = []
    state = "unknown"
    for response in described:
        for group in response.groups:
            state = str(group[2])
            members.extend(_decode_member(raw) for raw in group[5])
    committed_raw = await admin.list_consumer_group_offsets(group_id, partitions=tps)
    committed = {
        (tp.topic, tp.partition): meta.offset
        for tp, meta in committed_raw.items()
        if meta.offset >= 0
    }
    return GroupView(group_id, state, tuple(members), committed)


_MEMBER_SUFFIX = re.compile(r"-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _decode_member(raw: Any) -> MemberView:
    member_id, client_id, host, metadata, assignment = raw[:5]
    subscription: tuple[str, ...] = ()
    assigned: tuple[TopicPartitionKey, ...] = ()
    try:
        if metadata:
            subscription = tuple(ConsumerProtocolMemberMetadata.decode(metadata).subscription)
    except Exception:  # the broker may send another protocol's metadata: leave it unknown
        logger.debug("member metadata not decodable", extra={"member": member_id})
    try:
        if assignment:
            decoded = ConsumerProtocolMemberAssignment.decode(assignment)
            assigned = tuple((tp.topic, tp.partition) for tp in decoded.partitions())
    except Exception:
        logger.debug("member assignment not decodable", extra={"member": member_id})
    client = str(client_id) or _MEMBER_SUFFIX.sub("", str(member_id))  # id = client id + uuid
    return MemberView(str(member_id), client, str(host), subscription, assigned)


async def read_live_view(
    settings: Settings,
    *,
    topics: Sequence[TopicInfo],
    end_offsets: Mapping[TopicPartitionKey, int],
    partitions: Mapping[str, Iterable[int]],
    hints: GroupHints | None = None,
) -> LiveView:
    """Describe the deployment's consumer groups and fetch their committed offsets.

    The groups considered are those named with the topic prefix (every deferline process
    names its group so) or named in ``hints``. Read-only: nothing is joined or committed.
    A group the broker cannot describe is reported in ``errors`` and left out, rather than
    failing the replay.
    """
    hints = hints or GroupHints.for_prefix(settings.topic_prefix)
    tps = [TopicPartition(t.name, p) for t in topics for p in partitions.get(t.name, ())]
    errors: list[str] = []
    groups: list[GroupView] = []
    admin = make_admin(settings)
    try:  # closed even if its start fails or is cancelled (it holds connections)
        await start_client(admin, grace=5.0, name="live view admin")
        try:
            listed = {str(entry[0]) for entry in await admin.list_consumer_groups()}
        except KafkaError as exc:
            errors.append(f"listing groups: {type(exc).__name__}: {exc}")
            listed = set()
        # Some brokers (Tansu) list only groups that committed; the expected names are
        # described too (describing a group that does not exist shows it Empty).
        wanted = sorted(
            {g for g in listed if _ours(g, settings.topic_prefix, hints)}
            | set(hints.expected(topics))
        )
        for group_id in wanted:
            try:
                groups.append(await _describe(admin, group_id, tps))
            except Exception as exc:  # one odd group must not hide the others
                errors.append(f"group {group_id}: {type(exc).__name__}: {exc}")
    finally:
        await admin.close()
    return LiveView(
        taken_at=dt.datetime.now(dt.UTC),
        groups=tuple(groups),
        topics=tuple(topics),
        end_offsets=dict(end_offsets),
        hints=hints,
        errors=tuple(errors),
    )
