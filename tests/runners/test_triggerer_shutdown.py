"""A lane shutting down starts no rebuild and leaves none running over closed clients.

A peer joining or leaving while this member releases its partitions can bring an
assignment in the middle of ``release_all``; a rebuild started then used to read over
clients that ``close`` was stopping, opening a connection nothing closed. No broker here:
the group consumer and the reader are fakes whose stops are noted, in order.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from deferline.engine import TriggerSupervisor
from deferline.runners.triggerer.testing import (
    LaneOptions,
    MemoryCheckpointStore,
    TriggererMetrics,
    TriggerLane,
)
from deferline.topics import Settings

from tests.fakes import FakeConsumer, FakeKafka


def make_lane(journal: list[str]) -> TriggerLane:
    supervisor = TriggerSupervisor(capacity=10, on_event=lambda outcome: None)
    lane = TriggerLane(
        Settings(bootstrap_servers="unused:9092"),
        queue=None,
        options=LaneOptions(member="m"),
        supervisor=supervisor,
        emitter=cast(Any, None),  # nothing is emitted
        store=MemoryCheckpointStore(),
        metrics=TriggererMetrics(),
        cipher=None,
        cancel=lambda trigger_id, kill=False: None,
        on_fatal=lambda exc: None,
        task_partitions=1,
    )
    kafka = FakeKafka()
    consumer: Any = FakeConsumer(kafka, on_stop=lambda: journal.append("consumer stopped"))
    reader: Any = FakeConsumer(kafka, on_stop=lambda: journal.append("reader stopped"))
    lane._consumer, lane._reader = consumer, reader
    return lane


async def test_an_assignment_arriving_during_release_starts_no_rebuild() -> None:
    journal: list[str] = []
    lane = make_lane(journal)
    await lane.release_all()
    consumer = lane._consumer
    assert isinstance(consumer, FakeConsumer)
    await lane.assign(2, frozenset({3}))
    assert lane._rebuild is None, "a rebuild was started while shutting down"
    assert lane.owned == []
    assert journal == []
    assert consumer.paused() == set(), "nothing paused for a rebuild"
    await lane.close()
    assert journal == ["consumer stopped", "reader stopped"]


async def test_close_cancels_a_running_rebuild_before_it_stops_the_clients() -> None:
    journal: list[str] = []
    lane = make_lane(journal)

    async def rebuild() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            journal.append("rebuild cancelled")
            raise

    lane._rebuild = asyncio.create_task(rebuild())
    await asyncio.sleep(0)  # the rebuild is waiting on the broker
    await lane.close()
    assert journal == ["rebuild cancelled", "consumer stopped", "reader stopped"]


async def test_a_loss_cancelled_on_the_way_does_not_fail_the_release() -> None:
    """A rebalance's loss still cancelling triggers when a SIGTERM comes, and cancelled on the
    way: the member still releases its partitions and stops cleanly (it used to raise the
    loss's CancelledError out of ``release_all``, and the triggerer exited 1)."""
    lane = make_lane([])
    never = asyncio.get_running_loop().create_future()
    loss = asyncio.create_task(asyncio.wait_for(never, None), name="cancel-lost")
    lane._losing = loss
    await asyncio.sleep(0)
    loss.cancel()
    await lane.release_all()
    assert loss.cancelled()
    await lane.close()
