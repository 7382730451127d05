"""The per-partition ownership lifecycle (one enum, one transition table, illegal moves
refused), and decisions routed to their task partition."""

from __future__ import annotations

import pytest
from deferline.engine import Emit
from deferline.runners.member import IllegalPartitionMove as IllegalMove
from deferline.runners.member import PartitionPhase as Hold
from deferline.runners.scheduler.testing import Ownership, PartitionRouter
from deferline.schemas import CancelRequest, TaskKey, TaskStateRecord
from deferline.topics import partition_for
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

PARTITIONS = range(6)


class OwnershipMachine(RuleBasedStateMachine):
    """Random rebalances, takeovers and fences against a model of what may be written."""

    def __init__(self) -> None:
        super().__init__()
        self.ownership = Ownership()
        self.model: dict[int, Hold] = {}
        self.revoked = False  # the group revoked everything and has not assigned yet

    @rule()
    def revoke(self) -> None:
        quiesced, released = self.ownership.revoke()
        assert quiesced == sorted(p for p, h in self.model.items() if h is Hold.ACTIVE)
        assert released == sorted(p for p, h in self.model.items() if h is Hold.ACQUIRING)
        self.model = {p: Hold.QUIESCED for p, h in self.model.items() if h is not Hold.ACQUIRING}
        self.revoked = True
        assert not any(self.ownership.writable(p) for p in PARTITIONS), "nothing written"

    @rule(mine=st.sets(st.sampled_from(PARTITIONS)))
    def assign(self, mine: set[int]) -> None:
        busy = any(h is not Hold.QUIESCED for h in self.model.values())
        if busy:
            with pytest.raises(IllegalMove, match="without a revocation"):
                self.ownership.assign(mine)
            return
        change = self.ownership.assign(mine)
        quiesced = set(self.model)
        assert set(change.kept) == quiesced & mine, "kept: owned before and now"
        assert set(change.released) == quiesced - mine, "only what moved is dropped"
        assert set(change.acquired) == mine - quiesced, "only what is new is taken over"
        self.model = {p: Hold.ACTIVE for p in change.kept}
        self.model.update({p: Hold.ACQUIRING for p in change.acquired})
        self.revoked = False

    @rule(p=st.sampled_from(PARTITIONS))
    def acquired(self, p: int) -> None:
        if self.model.get(p) is not Hold.ACQUIRING:
            with pytest.raises(IllegalMove):
                self.ownership.acquired(p)
            return
        self.ownership.acquired(p)
        self.model[p] = Hold.ACTIVE

    @rule(p=st.sampled_from(PARTITIONS))
    def fenced(self, p: int) -> None:
        assert self.ownership.lose(p) == (p in self.model)
        self.model.pop(p, None)

    @invariant()
    def agrees(self) -> None:
        for p in PARTITIONS:
            assert self.ownership.hold(p) is self.model.get(p)
            assert self.ownership.writable(p) == (self.model.get(p) is Hold.ACTIVE)
        assert self.ownership.owned() == sorted(self.model)


OwnershipMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30)
test_ownership_machine = OwnershipMachine.TestCase


def test_illegal_moves_name_the_partition_and_both_stages() -> None:
    ownership = Ownership()
    with pytest.raises(IllegalMove, match="partition 3 is not being acquired"):
        ownership.acquired(3)
    ownership.assign({3})
    ownership.acquired(3)
    with pytest.raises(IllegalMove, match=r"partitions \[3\] were assigned again"):
        ownership.assign({3})
    with pytest.raises(IllegalMove, match="partition 3 cannot go from active to acquiring"):
        ownership._move(3, Hold.ACQUIRING)


@given(st.lists(st.integers(0, 30), max_size=40), st.integers(1, 7))
def test_decisions_go_to_their_tasks_partition_in_order(ids: list[int], partitions: int) -> None:
    router = PartitionRouter(partitions)
    tasks = [TaskKey(dag_id="d", task_id=f"t{i}", run_id="r") for i in ids]
    out = [Emit(TaskStateRecord(task=task, state="queued")) for task in tasks]
    out += [
        Emit(CancelRequest(trigger_id=f"trigger-{i}", task=task), queue=None)
        for i, task in enumerate(tasks)
    ]
    routed = router.route(out)
    for p, batch in routed.items():
        assert batch.out == [e for e in out if router.partition_of(_task_of(e)) == p]
        for emit in batch.out:
            assert partition_for(_task_of(emit).encode(), partitions) == p
    assert sum(len(b.out) for b in routed.values()) == len(out)
    for p in range(partitions):
        router.forget(p)
    assert router._known == {}


def _task_of(emit: Emit) -> str:
    record = emit.record
    return record.task.ti_key if isinstance(record, CancelRequest) else emit.key
