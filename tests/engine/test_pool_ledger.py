"""The pool ledger: exact slot counts under any interleaving of wants, releases, re-deliveries
and ledger owner changes."""

from __future__ import annotations

import datetime as dt

import pytest
from deferline.engine import PoolEntry, PoolLedger, Pools, grant_matches
from deferline.schemas import PoolGrant, PoolWant, SchemaError, encode
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
SIZES = {"a": 2, "b": 3}
KEYS = [f"dag/t{i}/run/-1" for i in range(7)]


def want(
    pool: str = "a", slots: int = 1, *, try_number: int = 1, priority: int = 1, at: int = 0
) -> PoolWant:
    return PoolWant(
        pool=pool,
        slots=slots,
        priority_weight=priority,
        scheduled_at=T0 + dt.timedelta(seconds=at),
        try_number=try_number,
        partition=3,
    )


def granted(writes: list[PoolEntry]) -> list[str]:
    return [w.ti_key for w in writes if w.kind == "grant" and w.value is not None]


def freed(writes: list[PoolEntry]) -> list[str]:
    return [w.ti_key for w in writes if w.kind == "grant" and w.value is None]


# -- examples ---------------------------------------------------------------------------------


def test_grants_in_priority_order_while_the_pool_has_room() -> None:
    ledger = PoolLedger(Pools(slots={"a": 2}))
    ledger.apply(PoolEntry("want", "k1", want(priority=1, at=0)))
    ledger.apply(PoolEntry("want", "k2", want(priority=5, at=2)))
    ledger.apply(PoolEntry("want", "k3", want(priority=5, at=1)))
    assert granted(ledger.decide()) == ["k3", "k2"]
    assert ledger.usage()["a"] == (2, 2)
    assert ledger.waiting() == {"a": 1}
    assert ledger.decide() == [], "nothing moves until a slot is freed"
    ledger.apply(PoolEntry("want", "k2"))  # k2 is done: its owner tombstones the want
    writes = ledger.decide()
    assert freed(writes) == ["k2"]
    assert granted(writes) == ["k1"]


def test_times_in_other_offsets_are_ordered_as_instants() -> None:
    ledger = PoolLedger(Pools(slots={"a": 1}))
    later = want(at=3600)  # 01:00 UTC
    earlier = want().model_copy(  # 00:30 UTC, written at +02:00
        update={
            "scheduled_at": dt.datetime(
                2026, 1, 1, 2, 30, tzinfo=dt.timezone(dt.timedelta(hours=2))
            )
        }
    )
    ledger.apply(PoolEntry("want", "later", later))
    ledger.apply(PoolEntry("want", "earlier", earlier))
    assert granted(ledger.decide()) == ["earlier"]


def test_a_want_that_does_not_fit_keeps_its_place_while_a_smaller_one_goes() -> None:
    ledger = PoolLedger(Pools(slots={"a": 2}))
    ledger.apply(PoolEntry("want", "small0", want()))
    assert granted(ledger.decide()) == ["small0"]
    ledger.apply(PoolEntry("want", "big", want(slots=2, priority=9)))
    ledger.apply(PoolEntry("want", "small1", want(priority=1)))
    assert granted(ledger.decide()) == ["small1"]
    ledger.apply(PoolEntry("want", "small0"))
    ledger.apply(PoolEntry("want", "small1"))
    assert granted(ledger.decide()) == ["big"]


def test_a_new_try_frees_the_old_grant_and_waits_again() -> None:
    ledger = PoolLedger(Pools(slots={"a": 1}))
    ledger.apply(PoolEntry("want", "k", want(try_number=1)))
    ledger.apply(PoolEntry("want", "other", want(at=5)))
    assert granted(ledger.decide()) == ["k"]
    ledger.apply(PoolEntry("want", "k", want(try_number=2, at=9)))
    writes = ledger.decide()
    assert (writes[0].ti_key, writes[0].value) == ("k", None)
    assert granted(writes) == ["other"], "the new try queues behind the older want"


def test_own_grants_read_back_in_any_order_change_nothing() -> None:
    ledger = PoolLedger(Pools(slots={"a": 1}))
    ledger.apply(PoolEntry("want", "k1", want()), offset=0)
    first = ledger.decide()
    ledger.apply(PoolEntry("want", "k1"), offset=1)
    ledger.apply(PoolEntry("want", "k2", want(at=1)), offset=2)
    second = ledger.decide()
    assert freed(second) == ["k1"]
    assert granted(second) == ["k2"]
    for offset, entry in enumerate([*second, *first, *first], start=3):  # late, duplicated
        ledger.apply(entry, offset=offset)
    assert ledger.live_grants() == {"k2": PoolGrant(pool="a", slots=1, try_number=1, partition=3)}


def test_redelivered_offsets_are_skipped() -> None:
    ledger = PoolLedger(Pools(slots={"a": 1}))
    ledger.apply(PoolEntry("want", "k1", want()), offset=0)
    ledger.apply(PoolEntry("want", "k1"), offset=1)
    ledger.apply(PoolEntry("want", "k1", want()), offset=0)  # an old record again
    assert ledger.decide() == []
    assert ledger.skipped == 1


def test_a_rebuilt_ledger_frees_grants_whose_want_is_gone_and_keeps_the_rest() -> None:
    ledger = PoolLedger(Pools(slots={"a": 2}))
    ledger.apply(PoolEntry("want", "kept", want()))
    one = PoolGrant(pool="a", slots=1, try_number=1, partition=3)
    ledger.apply(PoolEntry("grant", "kept", one))
    ledger.apply(PoolEntry("grant", "gone", one))
    ledger.apply(PoolEntry("want", "next", want(at=1)))
    ledger.apply(PoolEntry("want", "last", want(at=2)))
    writes = ledger.decide()
    assert freed(writes) == ["gone"]
    assert granted(writes) == ["next"], "one slot is still held by 'kept'"
    assert ledger.usage()["a"] == (2, 2)


def test_a_lowered_size_takes_nothing_from_holders() -> None:
    ledger = PoolLedger(Pools(slots={"a": 3}))
    for i in range(4):
        ledger.apply(PoolEntry("want", f"k{i}", want(at=i)))
    assert granted(ledger.decide()) == ["k0", "k1", "k2"]
    ledger.pools = Pools(slots={"a": 1})
    ledger.apply(PoolEntry("want", "k0"))
    assert freed(ledger.decide()) == ["k0"], "k3 waits: 2 held, size 1"
    ledger.apply(PoolEntry("want", "k1"))
    ledger.apply(PoolEntry("want", "k2"))
    assert granted(ledger.decide()) == ["k3"]


def test_a_want_of_a_task_already_holding_is_counted_at_once_even_over_the_size() -> None:
    """Tasks admitted before the ledger (one scheduler admitting locally) are adopted: they
    are counted at once, and nothing new is admitted while the pool is over its size."""
    ledger = PoolLedger(Pools(slots={"a": 1}))
    ledger.apply(PoolEntry("want", "new", want(priority=9)))
    ledger.apply(PoolEntry("want", "ran1", want(at=1).model_copy(update={"held": True})))
    ledger.apply(PoolEntry("want", "ran2", want(at=2).model_copy(update={"held": True})))
    assert granted(ledger.decide()) == ["ran1", "ran2"]
    assert ledger.usage()["a"] == (2, 1)
    ledger.apply(PoolEntry("want", "ran1"))
    assert granted(ledger.decide()) == []
    ledger.apply(PoolEntry("want", "ran2"))
    assert granted(ledger.decide()) == ["new"]


def test_entries_round_trip_and_bad_keys_are_refused() -> None:
    entry = PoolEntry("want", "d/t/r/-1", want())
    assert entry.key == "want/d/t/r/-1"
    assert PoolEntry.read(entry.key.encode(), entry.encode()) == entry
    assert PoolEntry.read(b"grant/d/t/r/-1", None) == PoolEntry("grant", "d/t/r/-1")
    with pytest.raises(SchemaError):
        PoolEntry.read(b"lease/x", None)
    with pytest.raises(SchemaError):
        PoolEntry.read(b"want/x", encode(PoolGrant(pool="a", slots=1, try_number=1, partition=0)))


# -- the state machine ------------------------------------------------------------------------


class LedgerMachine(RuleBasedStateMachine):
    """Partition owners write wants and release them; the ledger owner reads the topic late,
    sees re-deliveries, writes its grants late, duplicated and re-ordered across keys, and is
    replaced by a ledger rebuilt from the compacted topic. Owners start a task only when the
    topic shows a grant for its live want, and release it only by tombstoning the want."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes = dict(SIZES)
        self.topic: list[PoolEntry] = []
        self.ledger = PoolLedger(Pools(slots=self.sizes, default_slots=None))
        self.cursor = 0
        self.unsent: list[PoolEntry] = []  # decided by the ledger, not on the topic yet
        self.wants: dict[str, PoolWant] = {}  # the owners' live wants
        self.tries: dict[str, int] = dict.fromkeys(KEYS, 0)
        self.holding: dict[str, PoolWant] = {}
        self.excess: dict[str, int] = {}  # live grants when a size was lowered
        self.clock = 0

    # owners

    @rule(
        key=st.sampled_from(KEYS),
        pool=st.sampled_from(sorted(SIZES)),
        slots=st.integers(1, 2),
        priority=st.integers(0, 3),
    )
    def new_try(self, key: str, pool: str, slots: int, priority: int) -> None:
        if key in self.holding:
            return  # a new attempt comes only after the last one ended
        self.tries[key] += 1
        self.clock += 1
        value = want(pool, slots, try_number=self.tries[key], priority=priority, at=self.clock)
        self.wants[key] = value
        self.topic.append(PoolEntry("want", key, value))

    @rule(key=st.sampled_from(KEYS))
    def rewrite_want(self, key: str) -> None:
        if key in self.wants:  # a restarted owner publishes the same want again
            self.topic.append(PoolEntry("want", key, self.wants[key]))

    @rule(key=st.sampled_from(KEYS))
    def release(self, key: str) -> None:
        if key in self.wants:
            del self.wants[key]
            self.holding.pop(key, None)
            self.topic.append(PoolEntry("want", key))

    @rule(key=st.sampled_from(KEYS))
    def start(self, key: str) -> None:
        value = self.wants.get(key)
        if (
            value is not None
            and key not in self.holding
            and grant_matches(self.visible_grants().get(key), value)
        ):
            self.holding[key] = value

    # the ledger owner

    @rule(n=st.integers(1, 6))
    def ledger_reads(self, n: int) -> None:
        for offset in range(self.cursor, min(self.cursor + n, len(self.topic))):
            self.ledger.apply(self.topic[offset], offset=offset)
            self.cursor = offset + 1

    @rule(data=st.data())
    def ledger_reads_again(self, data: st.DataObject) -> None:
        if self.cursor:
            offset = data.draw(st.integers(0, self.cursor - 1))
            self.ledger.apply(self.topic[offset], offset=offset)

    @rule()
    def ledger_decides(self) -> None:
        self.unsent += self.ledger.decide()

    @rule(data=st.data(), duplicate=st.booleans())
    def ledger_writes(self, data: st.DataObject, duplicate: bool) -> None:
        """The ledger's writes land; writes of different keys in any order."""
        pending = list(self.unsent)
        self.unsent = []
        while pending:
            heads = list({w.ti_key: i for i, w in reversed(list(enumerate(pending)))}.values())
            entry = pending.pop(data.draw(st.sampled_from(sorted(heads))))
            self.topic.append(entry)
            if duplicate:
                self.topic.append(entry)

    @rule()
    def ledger_owner_changes(self) -> None:
        """The owner dies with writes unsent (an aborted transaction); the next owner folds
        the compacted topic (latest value per key), reads to the end and decides."""
        self.unsent = []
        latest: dict[str, tuple[int, PoolEntry]] = {}
        for offset, entry in enumerate(self.topic):
            latest[entry.key] = (offset, entry)
        self.ledger = PoolLedger(Pools(slots=self.sizes, default_slots=None))
        for offset, entry in sorted(latest.values(), key=lambda pair: pair[0]):
            if entry.value is not None:  # compaction dropped old tombstones
                self.ledger.apply(entry, offset=offset)
        self.cursor = len(self.topic)
        self.unsent += self.ledger.decide()
        self.check_liveness()

    @rule(pool=st.sampled_from(sorted(SIZES)), size=st.integers(1, 4))
    def resize(self, pool: str, size: int) -> None:
        if size < self.sizes[pool]:
            live = self.ledger_used(pool)
            self.excess[pool] = max(self.excess.get(pool, 0), live)
        self.sizes[pool] = size
        self.ledger.pools = Pools(slots=dict(self.sizes), default_slots=None)

    @precondition(lambda self: self.ledger.deciding)
    @rule()
    def ledger_catches_up_and_decides(self) -> None:
        self.ledger_reads(len(self.topic))
        self.unsent += self.ledger.decide()
        self.check_liveness()

    # checks

    def visible_grants(self) -> dict[str, PoolGrant]:
        grants: dict[str, PoolGrant] = {}
        for entry in self.topic:
            if entry.kind == "grant":
                if entry.value is None:
                    grants.pop(entry.ti_key, None)
                else:
                    assert isinstance(entry.value, PoolGrant)
                    grants[entry.ti_key] = entry.value
        return grants

    def ledger_used(self, pool: str) -> int:
        return sum(g.slots for g in self.ledger.live_grants().values() if g.pool == pool)

    def bound(self, pool: str) -> int:
        return max(self.sizes[pool], self.excess.get(pool, 0))

    def check_liveness(self) -> None:
        """Once caught up and decided: a want waits only while its pool lacks room for it."""
        for key, value in self.wants.items():
            if self.ledger.want(key) != value:
                continue  # a rewrite not read yet
            if grant_matches(self.ledger.grant(key), value):
                continue
            free = self.sizes[value.pool] - self.ledger_used(value.pool)
            assert value.slots > free, f"{key} waits with {free} slots free"

    @invariant()
    def holders_never_exceed_the_size(self) -> None:
        for pool in self.sizes:
            held = sum(w.slots for w in self.holding.values() if w.pool == pool)
            used = self.ledger_used(pool)
            assert held <= self.bound(pool), f"{pool}: {held} slots held, size {self.sizes[pool]}"
            assert used <= self.bound(pool), f"{pool}: {used} slots granted"
            if pool in self.excess:
                self.excess[pool] = min(self.excess[pool], used)

    @invariant()
    def holders_are_counted_by_the_ledger(self) -> None:
        if self.ledger.deciding and self.cursor == len(self.topic):
            for key, value in self.holding.items():
                assert grant_matches(self.ledger.grant(key), value), key

    def teardown(self) -> None:
        """Liveness: with every holder finishing in turn, every want that fits is granted."""
        for _ in range(4 * len(KEYS) + 4):
            self.ledger_writes_all()
            self.ledger_reads(len(self.topic))
            self.unsent += self.ledger.decide()
            self.ledger_writes_all()
            for key in list(self.wants):
                self.start(key)
            for key in list(self.holding):
                self.release(key)
        fits = {
            (key, value.try_number)
            for key, value in self.wants.items()
            if value.slots <= self.sizes[value.pool]
        }
        assert not fits, f"wants never granted: {sorted(fits)}"

    def ledger_writes_all(self) -> None:
        self.topic += self.unsent
        self.unsent = []


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestLedgerMachine = LedgerMachine.TestCase
