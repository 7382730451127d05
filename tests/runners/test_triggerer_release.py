"""Once a lane releases its partitions (shutdown), nothing more is emitted for them.

Outcomes keep coming while the release flushes, checkpoints and commits (the supervisor
stops the triggers only after the member has left the group): each one is dropped, since
the next owner rebuilds the partition and fires the trigger itself. No broker here: the
emitter is a fake whose flush lets a trigger fire, as the loop does while a flush waits.
"""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition
from deferline.engine import TriggerOutcome, TriggerSupervisor
from deferline.runners.triggerer.testing import (
    Emission,
    Emitter,
    LaneOptions,
    MemoryCheckpointStore,
    OwnedPartition,
    TriggererMetrics,
    TriggerLane,
    TriggerRef,
)
from deferline.schemas import DeferRequest, TaskKey, encode, make_trigger_id
from deferline.topics import Settings


class FiringEmitter:
    """An emitter that records what is submitted; ``during_flush`` runs while it flushes."""

    def __init__(self) -> None:
        self.submitted: list[Emission] = []
        self.during_flush: list[Any] = []
        self.backlog = 0

    def submit(self, emission: Emission) -> None:
        self.submitted.append(emission)

    async def flush(self, within: float | None = None) -> bool:
        for fire in self.during_flush:
            fire()
        return True


TASK = TaskKey(dag_id="d", task_id="t", run_id="r")
TID = make_trigger_id(TASK, 0)
REQUEST = DeferRequest(
    trigger_id=TID,
    task=TASK,
    classpath="deferline.engine.triggers.DateTimeTrigger",
    kwargs={"moment": "2030-01-01T00:00:00+00:00"},
)


def fired(ref: TriggerRef) -> TriggerOutcome:
    return TriggerOutcome(TID, "fired", {"n": 1}, f"e-{TID}", context=ref)


def make_lane(
    emitter: FiringEmitter | Emitter, *, task_partitions: int | None = 1
) -> tuple[TriggerLane, TriggerRef]:
    """A lane owning partition 0, live, and a trigger of it."""
    lane = TriggerLane(
        Settings(bootstrap_servers="unused:9092"),
        queue=None,
        options=LaneOptions(member="m"),
        supervisor=TriggerSupervisor(capacity=10, on_event=lambda outcome: None),
        emitter=emitter,  # type: ignore[arg-type]
        store=MemoryCheckpointStore(),
        metrics=TriggererMetrics(),
        cipher=None,
        cancel=lambda trigger_id, *, kill=False: None,
        on_fatal=lambda exc: None,
        task_partitions=task_partitions,
    )
    part = OwnedPartition(
        number=0,
        defer_tp=TopicPartition(lane.defer_topic, 0),
        resume_tp=TopicPartition(lane.resume_topic, 0),
    )
    part.book.follow()
    part.book.rebuilt()
    lane._parts[0] = part
    return lane, TriggerRef(lane.route, part, TID.encode(), encode(REQUEST))


def test_an_outcome_of_a_live_partition_is_emitted() -> None:
    emitter = FiringEmitter()
    lane, ref = make_lane(emitter)

    lane.handle_outcome(ref, fired(ref))

    assert len(emitter.submitted) == 1


async def test_an_outcome_fired_while_the_lane_releases_is_not_emitted() -> None:
    emitter = FiringEmitter()
    lane, ref = make_lane(emitter)
    emitter.during_flush.append(lambda: lane.handle_outcome(ref, fired(ref)))

    await lane.release_all()

    assert emitter.submitted == [], "an outcome fired during the release was emitted"
    assert lane.owned == []


async def test_an_outcome_of_a_partition_lost_and_won_back_is_not_emitted() -> None:
    """The old copy's trigger (being cancelled) fires after the partition came back: the
    new owner's rebuild runs the trigger again, so the old copy's outcome is dropped."""
    emitter = FiringEmitter()
    lane, old_ref = make_lane(emitter)
    await lane.quiesce(frozenset({0}))
    lane._lose([lane._parts[0]])  # the assignment said: lost
    await lane._await_losing()
    won_back = OwnedPartition(
        number=0,
        defer_tp=TopicPartition(lane.defer_topic, 0),
        resume_tp=TopicPartition(lane.resume_topic, 0),
    )
    won_back.book.follow()
    won_back.book.rebuilt()
    lane._parts[0] = won_back

    lane.handle_outcome(old_ref, fired(old_ref))

    assert emitter.submitted == []
