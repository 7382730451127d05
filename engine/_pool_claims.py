"""A task table's side of the pool ledger: the wants it publishes and the grants it reads.

In ledger admission (:class:`LedgerAdmission`) a table does not admit tasks of limited pools
itself: it publishes a :class:`~deferline.schemas.PoolWant` for each task that wants or holds
slots, tombstones it when the task no longer does, and starts a ``scheduled`` task when it
reads a grant for the task's current attempt. Every decision is a function of (task state,
want, grant), so a table rebuilt from the topics takes the same ones again; nothing here needs
a checkpoint (the pools topic is read from its beginning at every start).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from deferline.schemas import PoolGrant, PoolWant

from ._pool_ledger import PoolEntry, grant_matches
from ._task_pools import Pools
from ._taskstate_values import _View

__all__ = ["LedgerAdmission", "PoolClaims"]


def _one_partition(ti_key: str) -> int:
    return 0


@dataclass(frozen=True, slots=True)
class LedgerAdmission:
    """Admit tasks of limited pools through the pool ledger instead of in the table.

    ``partition_of`` gives a task instance key's partition of the tasks topic (the scheduler
    passes Kafka's default partitioner over the topic's partition count); it is written in
    each want so the grant reaches the partition's owner. Pools without a slot count are
    still admitted in the table at once: new work there pays no round trip.
    """

    partition_of: Callable[[str], int] = field(default=_one_partition)


class PoolClaims:
    """Per task instance of a limited pool: the want published (or read), the grant read.

    ``dirty`` holds the keys whose task, want or grant changed since the table last
    settled them (:meth:`settle`).
    """

    __slots__ = ("_grants", "_unread", "_wants", "admission", "dirty", "outbox", "pools")

    def __init__(self, pools: Pools, admission: LedgerAdmission) -> None:
        self.pools = pools
        self.admission = admission
        self._wants: dict[str, PoolWant] = {}
        self._grants: dict[str, PoolGrant] = {}
        self._unread: dict[str, deque[PoolWant | None]] = {}  # own writes not read back
        self.dirty: set[str] = set()
        self.outbox: list[PoolEntry] = []

    def limited(self, pool: str) -> bool:
        """True when ``pool`` has a slot count (its tasks go through the ledger)."""
        return self.pools.size(pool) is not None

    def read(self, entry: PoolEntry) -> None:
        """Fold a pools-topic record of one of this table's tasks."""
        key = entry.ti_key
        if entry.kind == "grant":
            assert entry.value is None or isinstance(entry.value, PoolGrant)
            if entry.value is None:
                self._grants.pop(key, None)
            else:
                self._grants[key] = entry.value
            self.dirty.add(key)
            return
        assert entry.value is None or isinstance(entry.value, PoolWant)
        unread = self._unread.get(key)
        if unread and entry.value in unread:
            # One of our own wants read back; what we decided after it still stands.
            while unread.popleft() != entry.value:
                pass
            if not unread:
                del self._unread[key]
            return
        if entry.value is None:
            self._wants.pop(key, None)
        else:
            self._wants[key] = entry.value
        self.dirty.add(key)

    def settle(self, key: str, view: _View | None) -> bool:
        """Publish the want the task calls for; True if it is granted and should start now.

        A ``scheduled`` task (no next method) wants slots; a task holding slots keeps its
        want (a holder found without one gets one, so the ledger counts it); any other task
        has its want tombstoned, which lets the ledger free its grant.
        """
        record = view.record if view is not None else None
        target = view.target if view is not None else None
        wanting = (
            record is not None
            and target is not None
            and self.limited(target.pool)
            and record.state == "scheduled"
            and record.next_method is None
        )
        holding = (
            view is not None
            and target is not None
            and view.holds is not None
            and self.limited(target.pool)
        )
        current = self._wants.get(key)
        if not (wanting or holding):
            if current is not None:
                self._write(key, None)
            return False
        assert record is not None
        assert target is not None
        if (
            current is None
            or current.try_number != record.try_number
            or current.pool != target.pool
            or current.slots != target.pool_slots
        ):
            current = PoolWant(
                pool=target.pool,
                slots=target.pool_slots,
                priority_weight=target.priority_weight,
                scheduled_at=record.updated_at,
                try_number=record.try_number,
                partition=self.admission.partition_of(key),
                held=not wanting,
            )
            self._write(key, current)
        return wanting and grant_matches(self._grants.get(key), current)

    def drop_where(self, belongs: Callable[[str], bool]) -> None:
        """Forget the wants and grants of every key that ``belongs`` (its partition went
        to another scheduler; read again from the pools topic if it comes back)."""
        for book in (self._wants, self._grants, self._unread):
            for key in [key for key in book if belongs(key)]:
                del book[key]
        self.dirty = {key for key in self.dirty if not belongs(key)}
        self.outbox = [entry for entry in self.outbox if not belongs(entry.ti_key)]

    def grant(self, ti_key: str) -> PoolGrant | None:
        """The grant read for a task instance."""
        return self._grants.get(ti_key)

    def want(self, ti_key: str) -> PoolWant | None:
        """The want published (or read) for a task instance."""
        return self._wants.get(ti_key)

    def wanting(self) -> int:
        """Wants of this table without a matching grant read yet."""
        return sum(
            1 for key, want in self._wants.items() if not grant_matches(self._grants.get(key), want)
        )

    def _write(self, key: str, want: PoolWant | None) -> None:
        if want is None:
            self._wants.pop(key, None)
        else:
            self._wants[key] = want
        self._unread.setdefault(key, deque()).append(want)
        self.outbox.append(PoolEntry("want", key, want))
