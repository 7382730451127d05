"""Properties of the lane's pure parts: the partition book and the rebuild plan's fold."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from deferline.runners.member import MOVES, IllegalPartitionMove
from deferline.runners.member import PartitionPhase as Phase
from deferline.runners.triggerer.testing import (
    ActiveTriggerTable,
    PartitionBook,
    RebuildPlan,
    Span,
    Verdict,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

KEYS = st.sampled_from([b"a", b"b", b"c", b"d"])


class BookMachine(RuleBasedStateMachine):
    """A partition's book driven as a lane drives it: outcomes arrive in every phase, held
    ones are re-fed when the partition is kept (as the lane does), and every move is tried.
    """

    def __init__(self) -> None:
        super().__init__()
        self.book: PartitionBook[int] = PartitionBook()
        self.next_id = 0
        self.emitted: list[int] = []
        """Outcome ids emitted, in order."""
        self.fate: dict[int, str] = {}
        """Per outcome id: emitted, held, dropped, repeat."""
        self.keys: dict[int, bytes] = {}
        self.let_go = False
        """Released or lost: nothing may be emitted from here on."""
        self.done: set[bytes] = set()
        """Keys emitted and not tombstoned since: never emitted again."""
        self.watch_events: set[int] = set()
        """Outcome ids of standing watches' events (they claim no key)."""

    def _feed(self, outcome: int) -> None:
        phase = self.book.phase
        verdict = self.book.outcome(self.keys[outcome], outcome)
        if verdict is Verdict.EMIT:
            assert phase in (Phase.STARTING, Phase.ACTIVE), f"emitted while {phase.value}"
            assert not self.let_go, "emitted after the partition was let go"
            assert outcome not in self.emitted, "an outcome emitted twice"
            assert self.keys[outcome] not in self.done, "a key emitted twice"
            self.done.add(self.keys[outcome])
            self.emitted.append(outcome)
            self.fate[outcome] = "emitted"
        elif verdict is Verdict.HOLD:
            assert phase is Phase.QUIESCED
            self.fate[outcome] = "held"
        elif verdict is Verdict.REPEAT:
            assert phase in (Phase.STARTING, Phase.ACTIVE)
            assert self.keys[outcome] in self.done
            self.fate[outcome] = "repeat"
        else:
            assert phase not in (
                Phase.STARTING,
                Phase.ACTIVE,
                Phase.QUIESCED,
            )
            self.fate[outcome] = "dropped"

    @rule(key=KEYS)
    def outcome(self, key: bytes) -> None:
        self.next_id += 1
        self.keys[self.next_id] = key
        self._feed(self.next_id)

    @rule()
    def watch_event(self) -> None:
        """A standing watch's event claims no key: published while the partition emits,
        held while it is quiesced (``hold``), dropped once it is let go."""
        self.next_id += 1
        outcome = self.next_id
        self.watch_events.add(outcome)
        phase = self.book.phase
        if self.book.emitting:
            assert not self.let_go
            self.fate[outcome] = "emitted"
        elif self.book.hold(outcome):
            assert phase is Phase.QUIESCED
            self.fate[outcome] = "held"
        else:
            assert phase not in (Phase.STARTING, Phase.ACTIVE, Phase.QUIESCED)
            self.fate[outcome] = "dropped"

    @rule(key=KEYS)
    def tombstone_read(self, key: bytes) -> None:
        assert self.book.tombstoned(key) is (key in self.done)
        self.done.discard(key)

    @precondition(lambda self: self.book.phase is Phase.ACQUIRING)
    @rule()
    def follow(self) -> None:
        self.book.follow()

    @precondition(lambda self: self.book.phase is Phase.STARTING)
    @rule()
    def rebuilt(self) -> None:
        self.book.rebuilt()

    @precondition(lambda self: self.book.phase in (Phase.ACTIVE, Phase.QUIESCED))
    @rule(now=st.floats(0, 1e6))
    def quiesce(self, now: float) -> None:
        self.book.quiesce(now)
        assert self.book.phase is Phase.QUIESCED

    @precondition(lambda self: self.book.phase in (Phase.ACTIVE, Phase.QUIESCED))
    @rule()
    def keep(self) -> None:
        was_held = [o for o, fate in self.fate.items() if fate == "held"]
        held, _ = self.book.keep()
        assert held == was_held, "every held outcome is handed back once, in order"
        for outcome in held:
            if outcome in self.watch_events:  # the lane publishes it as it was numbered
                self.fate[outcome] = "emitted"
                continue
            self._feed(outcome)
            assert self.fate[outcome] in ("emitted", "repeat")

    @precondition(lambda self: self.book.phase is not Phase.GONE)
    @rule()
    def lose(self) -> None:
        self.book.gone()
        self.let_go = True
        self._held_dropped()

    @precondition(lambda self: self.book.phase not in (Phase.RELEASING, Phase.GONE))
    @rule()
    def release(self) -> None:
        assert self.book.release()
        self.let_go = True
        self._held_dropped()

    def _held_dropped(self) -> None:
        assert self.book.held == []
        for outcome, fate in self.fate.items():
            if fate == "held":
                self.fate[outcome] = "dropped"

    @rule(to=st.sampled_from(list(Phase)))
    def any_move_outside_the_table_is_refused(self, to: Phase) -> None:
        book = PartitionBook[int](phase=self.book.phase)
        if to in MOVES[book.phase]:
            book._move(to)
            assert book.phase is to
        else:
            with pytest.raises(IllegalPartitionMove):
                book._move(to)

    @invariant()
    def only_a_quiesced_partition_holds(self) -> None:
        if self.book.phase is not Phase.QUIESCED:
            assert self.book.held == []

    @invariant()
    def emitted_keys_are_done_until_their_tombstone(self) -> None:
        assert self.book.done == self.done


TestPartitionBook = BookMachine.TestCase
TestPartitionBook.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


@dataclass(frozen=True)
class Rec:
    key: bytes | None
    value: bytes | None
    offset: int
    timestamp: int


@st.composite
def partition_log(draw: st.DrawFn) -> list[Rec]:
    """A defer partition's records: keyed values, tombstones, keyless values, with gaps."""
    records = []
    offset = draw(st.integers(0, 5))
    for _ in range(draw(st.integers(0, 40))):
        key = draw(st.one_of(st.none(), KEYS))
        value = draw(st.one_of(st.none(), st.binary(min_size=1, max_size=4)))
        records.append(Rec(key, value, offset, 1_000 + offset))
        offset += draw(st.integers(1, 3))  # compaction leaves gaps
    return records


def fold(records: list[Rec], cuts: list[int], committed: int) -> RebuildPlan:
    end = records[-1].offset + 1 if records else 0
    plan = RebuildPlan(
        number=0,
        defer=Span(begin=0, end=end),
        resume=Span(begin=0, end=0),
        committed=committed,
        table=ActiveTriggerTable(),
        from_checkpoint=False,
    )
    bounds = [0, *sorted(set(cuts)), len(records)]
    for start, stop in itertools.pairwise(bounds):
        plan.fold(records[start:stop])
    plan.folded()
    return plan


@settings(max_examples=200, deadline=None)
@given(
    records=partition_log(),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    committed=st.integers(0, 60),
)
def test_folding_a_partition_in_any_batching_gives_the_same_table(
    records: list[Rec], cuts: list[int], committed: int
) -> None:
    cuts = [c for c in cuts if c <= len(records)]
    whole = fold(records, [], committed)
    sliced = fold(records, cuts, committed)
    assert dict(sliced.table.items()) == dict(whole.table.items())
    assert sliced.table.defer_offset == whole.table.defer_offset
    assert sliced.keyless == whole.keyless
    assert sliced.defer_read == whole.defer_read == len(records)
    latest: dict[bytes, bytes | None] = {}
    for record in records:
        if record.key is not None:
            latest[record.key] = record.value
    live = {key: value for key, value in latest.items() if value is not None}
    assert {key: entry.value for key, entry in whole.table.items()} == live
    assert whole.keyless == [
        (r.offset, r.value)
        for r in records
        if r.key is None and r.value is not None and r.offset >= committed
    ]
