"""The groups view: members, their partitions and lags, and what moved between two looks.

The coordinator says who owns what now; a rebalance is what changed between two successive
snapshots of the same group: a partition whose owner changed (or that had none for a while),
a member that is gone. How long a partition paused is the time between the last snapshot
that showed its old owner and the first that shows its new one (so it is known to within
one refresh interval). Pure: snapshots and times in, JSON out.
"""

from __future__ import annotations

import datetime as dt
from collections import deque
from dataclasses import dataclass
from typing import Any

from deferline.replay import GroupView, LiveView, TopicRole

__all__ = ["GroupTracker"]

_KEEP = 30
"""Moves and departures remembered per group."""

_ROLES = {
    TopicRole.DEFER: "triggerer",
    TopicRole.TASK_EVENTS: "scheduler",
    TopicRole.TASKS: "scheduler",
}


@dataclass(slots=True)
class _Moving:
    """A partition seen without its previous owner, waiting to be seen owned again."""

    owner: str
    since: float


@dataclass(frozen=True, slots=True)
class _Move:
    at: float
    topic: str
    partition: int
    before: str | None
    after: str | None
    paused_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "at": _iso(self.at),
            "topic": self.topic,
            "partition": self.partition,
            "from": self.before,
            "to": self.after,
            "paused_s": round(self.paused_s, 1),
        }


def _iso(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="seconds")


class _GroupHistory:
    def __init__(self) -> None:
        self.owners: dict[tuple[str, int], str] = {}
        self.seen_at = 0.0
        self.members: dict[str, str] = {}
        self.moving: dict[tuple[str, int], _Moving] = {}
        self.moves: deque[_Move] = deque(maxlen=_KEEP)
        self.left: deque[dict[str, Any]] = deque(maxlen=_KEEP)

    def observe(self, group: GroupView, now: float) -> None:
        owners = {tp: _name(m.client_id, m.member_id) for m in group.members for tp in m.assignment}
        members = {m.member_id: _name(m.client_id, m.member_id) for m in group.members}
        for member_id, name in self.members.items():
            if member_id not in members:
                self.left.appendleft({"at": _iso(now), "member": name, "member_id": member_id})
        for tp, before in self.owners.items():
            if owners.get(tp) != before and tp not in self.moving:
                self.moving[tp] = _Moving(before, self.seen_at or now)
        for tp, after in owners.items():
            moving = self.moving.pop(tp, None)
            if moving is not None and moving.owner != after:
                self.moves.appendleft(
                    _Move(now, tp[0], tp[1], moving.owner, after, now - moving.since)
                )
            elif tp not in self.owners and self.owners:
                self.moves.appendleft(_Move(now, tp[0], tp[1], None, after, 0.0))
        self.owners, self.members, self.seen_at = owners, members, now


def _name(client_id: str, member_id: str) -> str:
    return client_id or member_id


class GroupTracker:
    """Keeps one history per group across refreshes and renders the groups view."""

    def __init__(self) -> None:
        self._history: dict[str, _GroupHistory] = {}

    def observe(self, live: LiveView, now: float) -> list[dict[str, Any]]:
        """Record this snapshot and return the view of every triggerer and scheduler group."""
        out: list[dict[str, Any]] = []
        for role in (TopicRole.DEFER, TopicRole.TASK_EVENTS):
            for group in live.groups_for_role(role):
                history = self._history.setdefault(group.group_id, _GroupHistory())
                history.observe(group, now)
                out.append(self._view(live, group, _ROLES[role], history))
        return out

    def _view(
        self, live: LiveView, group: GroupView, role: str, history: _GroupHistory
    ) -> dict[str, Any]:
        topics = [
            t
            for t in live.topics
            if group.reads(t.name) or live.hints.is_role(group.group_id, t.role)
        ]
        partitions = []
        for topic in topics:
            if topic.role not in _ROLES:
                continue
            for (name, number), end in sorted(live.end_offsets.items()):
                if name != topic.name:
                    continue
                committed = live.committed(group, name, number)
                owners = group.owners(name, number)
                partitions.append(
                    {
                        "topic": name,
                        "partition": number,
                        "owner": _name(owners[0].client_id, owners[0].member_id)
                        if owners
                        else None,
                        "committed": committed,
                        "end": end,
                        "lag": None if committed is None else max(0, end - committed),
                    }
                )
        return {
            "group": group.group_id,
            "role": role,
            "state": group.state,
            "assignments_known": group.assignments_known,
            "members": [
                {
                    "member": _name(m.client_id, m.member_id),
                    "member_id": m.member_id,
                    "host": m.host,
                    "partitions": [f"{t}[{p}]" for t, p in sorted(m.assignment)],
                }
                for m in group.members
            ],
            "partitions": partitions,
            "moves": [m.to_json() for m in history.moves],
            "left": list(history.left),
        }
