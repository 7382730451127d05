"""CPU per outcome of a lane's ``handle_outcome`` (verdict, event encoded, queued), in process.

The fire path between the supervisor and the producer: a live partition, N fired outcomes
of distinct triggers, an emitter that only takes the emissions. Printed, never asserted::

    .venv/bin/python -m bench.bench_lane_outcomes [--n 50000] [--repeat 5]

Run from this checkout's root with another checkout's python to measure that build (the
script also builds the partition and refs of the lane before its split into parts, and a
lane from before tasks.events, which takes no ``task_partitions``).
"""

from __future__ import annotations

import argparse
import inspect
import time
from collections.abc import Callable
from typing import Any, cast

from aiokafka import TopicPartition
from deferline.engine import TriggerOutcome, TriggerSupervisor
from deferline.runners.triggerer.testing import (
    Emission,
    LaneOptions,
    MemoryCheckpointStore,
    OwnedPartition,
    TriggererMetrics,
    TriggerLane,
    TriggerRef,
)
from deferline.schemas import DeferRequest, TaskKey, encode, make_trigger_id
from deferline.topics import Settings

from bench._figures import Figure, Sitting


class TakingEmitter:
    """Takes every emission and sends nothing."""

    backlog = 0

    def submit(self, emission: Emission) -> None:
        pass


def live_partition(lane: TriggerLane) -> tuple[OwnedPartition, Callable[[bytes, bytes], Any]]:
    """Partition 0, live, and a maker of refs to it (either build of the lane)."""
    tps = TopicPartition(lane.defer_topic, 0), TopicPartition(lane.resume_topic, 0)
    if hasattr(OwnedPartition, "book"):
        part = OwnedPartition(number=0, defer_tp=tps[0], resume_tp=tps[1])
        part.book.follow()
        part.book.rebuilt()
        route: Any = getattr(lane, "route", lane)  # older builds: the ref carried the lane
        return part, lambda key, value: TriggerRef(route, part, key, value)
    old = cast(Any, OwnedPartition)(number=0, defer_tp=tps[0], resume_tp=tps[1])
    old.ready = old.live = True
    return old, lambda key, value: cast(Any, TriggerRef)(lane, 0, key, value)


def outcome_us(n: int, repeat: int) -> float:
    """Best CPU µs per outcome over ``repeat`` fresh lanes."""
    best = float("inf")
    # A build that copies events to tasks.events is told that topic's partition count.
    takes = "task_partitions" in inspect.signature(TriggerLane).parameters
    since_task_events: dict[str, Any] = {"task_partitions": 12} if takes else {}
    for _ in range(repeat):
        lane = TriggerLane(
            Settings(bootstrap_servers="unused:9092"),
            queue=None,
            options=LaneOptions(member="bench"),
            supervisor=TriggerSupervisor(capacity=10, on_event=lambda outcome: None),
            emitter=cast(Any, TakingEmitter()),
            store=MemoryCheckpointStore(),
            metrics=TriggererMetrics(),
            cipher=None,
            cancel=lambda trigger_id, *, kill=False: None,
            on_fatal=lambda exc: None,
            **since_task_events,
        )
        part, ref_to = live_partition(lane)
        lane._parts[0] = part
        fired = []
        for i in range(n):
            task = TaskKey(dag_id="d", task_id=f"t{i}", run_id="r")
            tid = make_trigger_id(task, 0)
            request = DeferRequest(
                trigger_id=tid,
                task=task,
                classpath="deferline.engine.triggers.DateTimeTrigger",
                kwargs={"moment": "2030-01-01T00:00:00+00:00"},
            )
            ref = ref_to(tid.encode(), encode(request))
            fired.append((ref, TriggerOutcome(tid, "fired", {"n": i}, f"e-{i}", context=ref)))
        handle = lane.handle_outcome
        started = time.process_time()
        for ref, outcome in fired:
            handle(ref, outcome)
        best = min(best, time.process_time() - started)
    return best / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    sitting = Sitting.begin("lane_outcomes")
    us = outcome_us(args.n, args.repeat)
    print(f"handle_outcome: {us:.2f} µs per outcome (best of {args.repeat}, {args.n:,} each)")
    sitting.write(
        [
            Figure(
                "triggerer.handle_outcome",
                "a fired outcome through the lane's `handle_outcome` (verdict, event encoded, "
                "queued), in process: CPU each",
                round(us, 2),
                "µs",
                note=f"best of {args.repeat}, {args.n:,} each",
            )
        ]
    )


if __name__ == "__main__":
    main()
