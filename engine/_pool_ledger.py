"""The pool ledger: slots of limited pools given out exactly, whoever owns which task partition.

Every scheduler owns a share of the task partitions, but a pool's size is global. The pools
topic (one partition, compacted) is a table of two kinds of keys: ``want/<ti_key>``
(:class:`~deferline.schemas.PoolWant`, written by the task's partition owner) and
``grant/<ti_key>`` (:class:`~deferline.schemas.PoolGrant`, written by the ledger owner). A
task holds slots only once it has a live grant, and the ledger grants only while the pool's
live grants plus the new slots fit in its size: holders never exceed the size, whatever the
group membership does. :class:`PoolLedger` is the ledger owner's fold; it does no I/O and
reads no clock.
"""

from __future__ import annotations

import datetime as dt
import heapq
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from deferline.schemas import PoolGrant, PoolWant, SchemaError, decode_as, encode

from ._task_pools import Pools

__all__ = ["PoolEntry", "PoolLedger", "grant_matches"]

logger = logging.getLogger(__name__)

PoolKind = Literal["want", "grant"]


@dataclass(frozen=True, slots=True)
class PoolEntry:
    """One record of the pools topic: a want or a grant of one task instance, or a tombstone
    of either (``value`` None)."""

    kind: PoolKind
    ti_key: str
    value: PoolWant | PoolGrant | None = None

    @property
    def key(self) -> str:
        """The message key: ``want/<ti_key>`` or ``grant/<ti_key>``."""
        return f"{self.kind}/{self.ti_key}"

    def encode(self) -> bytes | None:
        """The message value; None for a tombstone."""
        return None if self.value is None else encode(self.value)

    @classmethod
    def read(cls, key: bytes | None, value: bytes | None) -> PoolEntry:
        """Decode a pools-topic message; raises SchemaError if it is not a want or grant."""
        text = key.decode("utf-8", "replace") if key is not None else ""
        kind, _, ti_key = text.partition("/")
        if kind not in ("want", "grant") or not ti_key:
            raise SchemaError(f"pools key must be want/<ti_key> or grant/<ti_key>, got {text!r}")
        if value is None:
            return cls(kind, ti_key)  # type: ignore[arg-type]  # checked just above
        if kind == "want":
            return cls("want", ti_key, decode_as(value, PoolWant))
        return cls("grant", ti_key, decode_as(value, PoolGrant))


def grant_matches(grant: PoolGrant | None, want: PoolWant | None) -> bool:
    """True when ``grant`` gives the slots ``want`` asks for (same attempt, pool and slots)."""
    return (
        grant is not None
        and want is not None
        and grant.try_number == want.try_number
        and grant.pool == want.pool
        and grant.slots == want.slots
    )


def _grant_of(want: PoolWant) -> PoolGrant:
    return PoolGrant(
        pool=want.pool, slots=want.slots, try_number=want.try_number, partition=want.partition
    )


_Queued = tuple[int, dt.datetime, str, int]
"""A want waiting for slots: (-priority weight, scheduled at, ti_key, try number)."""


class PoolLedger:
    """Wants and grants of the pools topic, and the grants to write or tombstone. No I/O.

    A ledger starts *rebuilding*: it folds every record, grants included, as the latest value
    per key. The first :meth:`decide` (call it once the topic is read to its end, after the
    owner's producer fenced any predecessor) makes it the writer: from then on grant records
    read back are its own writes (a fenced predecessor's are never committed), so they are
    ignored and the ledger's grants are the ones it decided, whatever order or how many times
    the topic delivers them. ``offset`` guards against re-deliveries: a record at an offset
    below one already folded is skipped.

    Exactness: a grant is written only while the pool's live grants plus its slots are
    within the pool's size (the one exception: a want marked ``held``, whose attempt already
    holds its slots, is counted at once); a grant is tombstoned only when its want is tombstoned or
    replaced by one it does not match, which its owner writes only when the attempt holds no
    slot any more. A lowered size takes nothing from holders: it only stops new grants until
    enough are freed.
    """

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self._wants: dict[str, PoolWant] = {}
        self._grants: dict[str, PoolGrant] = {}
        self._used: dict[str, int] = {}
        self._queues: dict[str, list[_Queued]] = {}
        self._release: set[str] = set()
        self._held: set[str] = set()  # wants of attempts that already hold their slots
        self._deciding = False
        self._next_offset = 0
        self.skipped = 0
        """Records skipped as re-deliveries (by offset) or as the ledger's own grants."""

    # -- folding ---------------------------------------------------------------------------

    def apply(self, entry: PoolEntry, *, offset: int | None = None) -> None:
        """Fold one pools-topic record (``offset``: its position, to skip re-deliveries)."""
        if offset is not None:
            if offset < self._next_offset:
                self.skipped += 1
                return
            self._next_offset = offset + 1
        if entry.kind == "want":
            assert entry.value is None or isinstance(entry.value, PoolWant)
            self._fold_want(entry.ti_key, entry.value)
        elif self._deciding:
            self.skipped += 1  # our own write read back: the decision is already counted
        else:
            assert entry.value is None or isinstance(entry.value, PoolGrant)
            self._set_grant(entry.ti_key, entry.value)

    def apply_all(self, entries: Iterable[tuple[PoolEntry, int | None]]) -> None:
        """:meth:`apply` each (entry, offset)."""
        for entry, offset in entries:
            self.apply(entry, offset=offset)

    @property
    def position(self) -> int:
        """The offset after the last record folded with one."""
        return self._next_offset

    @property
    def deciding(self) -> bool:
        """True once :meth:`decide` was called: grants read back are ignored."""
        return self._deciding

    # -- deciding --------------------------------------------------------------------------

    def decide(self) -> list[PoolEntry]:
        """Grants to tombstone (freed) and to write (admitted), in the order to write them.

        The first call also reconciles what a rebuild found: grants whose want is gone or
        replaced are freed, wants without a grant are queued.
        """
        if not self._deciding:
            self._deciding = True
            self._release.update(self._grants)
            for key, want in self._wants.items():
                self._queue(key, want)
                if want.held:
                    self._held.add(key)
        out: dict[str, PoolEntry] = {}
        for key in sorted(self._release):
            grant = self._grants.get(key)
            if grant is not None and not grant_matches(grant, self._wants.get(key)):
                self._set_grant(key, None)
                out[key] = PoolEntry("grant", key)
        self._release.clear()
        for key in sorted(self._held):
            held = self._wants.get(key)
            if held is not None and held.held and not grant_matches(self._grants.get(key), held):
                grant = _grant_of(held)
                self._set_grant(key, grant)
                out[key] = PoolEntry("grant", key, grant)
        self._held.clear()
        for pool in sorted(self._queues):
            for key, grant in self._admit(pool):
                self._set_grant(key, grant)
                out[key] = PoolEntry("grant", key, grant)
        return list(out.values())

    # -- reading ---------------------------------------------------------------------------

    def grant(self, ti_key: str) -> PoolGrant | None:
        """The live grant of a task instance, as the ledger counts it."""
        return self._grants.get(ti_key)

    def want(self, ti_key: str) -> PoolWant | None:
        """The live want of a task instance."""
        return self._wants.get(ti_key)

    def live_grants(self) -> dict[str, PoolGrant]:
        """Every live grant, by ti_key (a copy)."""
        return dict(self._grants)

    def usage(self) -> dict[str, tuple[int, int | None]]:
        """Slots granted and pool size, per pool configured or granted."""
        names = set(self.pools.slots) | {p for p, n in self._used.items() if n}
        return {name: (self._used.get(name, 0), self.pools.size(name)) for name in sorted(names)}

    def waiting(self) -> dict[str, int]:
        """Wants without a matching grant, per pool."""
        counts: dict[str, int] = {}
        for key, want in self._wants.items():
            if not grant_matches(self._grants.get(key), want):
                counts[want.pool] = counts.get(want.pool, 0) + 1
        return counts

    # -- internals -------------------------------------------------------------------------

    def _fold_want(self, key: str, want: PoolWant | None) -> None:
        if want is None:
            self._wants.pop(key, None)
        else:
            self._wants[key] = want
            if self._deciding:
                self._queue(key, want)
                if want.held:
                    self._held.add(key)
        if key in self._grants and not grant_matches(self._grants[key], want):
            self._release.add(key)

    def _queue(self, key: str, want: PoolWant) -> None:
        if grant_matches(self._grants.get(key), want):
            return
        entry = (-want.priority_weight, want.scheduled_at, key, want.try_number)
        heapq.heappush(self._queues.setdefault(want.pool, []), entry)

    def _set_grant(self, key: str, grant: PoolGrant | None) -> None:
        old = self._grants.pop(key, None)
        if old is not None:
            self._used[old.pool] -= old.slots
        if grant is not None:
            self._grants[key] = grant
            self._used[grant.pool] = self._used.get(grant.pool, 0) + grant.slots

    def _admit(self, pool: str) -> list[tuple[str, PoolGrant]]:
        """Wants of ``pool`` to grant now, best first, while they fit; a want that needs more
        slots than are free keeps its place (a smaller one behind it may go first, as the
        single-table admission does)."""
        heap = self._queues[pool]
        size = self.pools.size(pool)
        admitted: list[tuple[str, PoolGrant]] = []
        held: list[_Queued] = []
        used = self._used.get(pool, 0)
        seen: set[str] = set()
        while heap:
            free = None if size is None else size - used
            if free is not None and free <= 0:
                break
            entry = heapq.heappop(heap)
            key = entry[2]
            want = self._wants.get(key)
            if (
                want is None
                or want.pool != pool
                or want.try_number != entry[3]
                or -want.priority_weight != entry[0]
                or want.scheduled_at != entry[1]
                or key in seen
                or grant_matches(self._grants.get(key), want)
            ):
                continue  # superseded, duplicate, or granted already
            seen.add(key)
            if free is not None and want.slots > free:
                held.append(entry)
                continue
            admitted.append((key, _grant_of(want)))
            used += want.slots
        for entry in held:
            heapq.heappush(heap, entry)
        if not heap:
            del self._queues[pool]
        return admitted
