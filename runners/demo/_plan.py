"""The demo's task mix: what each task waits for and when its condition comes true."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

__all__ = ["EXAMPLES", "KINDS", "DemoOptions", "TaskSpec", "make_plan"]


EXAMPLES = "deferline.engine.examples"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """How the demo runs.

    Attributes:
        tasks: how many tasks to submit.
        duration: triggers fire within this many seconds of submission.
        seed: seed of the task mix.
        slots: worker slots.
        deadline: the demo gives up this many seconds after it started.
        kill: SIGKILL one triggerer halfway.
        kill_scheduler: run two schedulers (each owning half the task partitions) and SIGKILL
            one of them halfway too.
        live: draw the live view (else print a line every few seconds).
        session_timeout_ms: triggerers' consumer-group session timeout (failover bound).
        topic_prefix: topic prefix (default: a fresh ``demo-<hex>.``).
        broker: ``tansu`` (embedded) or ``kafka`` (Apache Kafka from its jars).
    """

    tasks: int = 2000
    duration: float = 40.0
    seed: int = 7
    slots: int = 4
    deadline: float = 105.0
    kill: bool = True
    kill_scheduler: bool = False
    live: bool = True
    session_timeout_ms: int = 6000
    topic_prefix: str | None = None
    broker: str = "tansu"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task of the demo and what it waits for."""

    name: str
    kind: str
    operator: str
    op_kwargs: dict[str, Any]
    expect: str
    at: float | None = None  # when the helper makes its condition true (seconds)


# kind, share of the tasks, label
KINDS: tuple[tuple[str, float, str], ...] = (
    ("timer", 0.0, "timer (TimeDeltaTrigger)"),  # the rest
    ("multi", 0.08, "defers 3 times"),
    ("end_from_trigger", 0.10, "ends from the trigger"),
    ("start_from_trigger", 0.05, "starts from the trigger"),
    ("timeout", 0.07, "times out"),
    ("file", 0.15, "file (FileTrigger)"),
    ("http", 0.15, "HTTP (HttpTrigger)"),
    ("kafka", 0.025, "Kafka message"),
)


def make_plan(
    options: DemoOptions, *, files: Path, http_base: str, signals_topic: str
) -> list[TaskSpec]:
    """The task mix, deterministic for a seed."""
    rng = random.Random(options.seed)
    n = options.tasks
    counts = {kind: int(n * share) for kind, share, _ in KINDS}
    counts["timer"] = n - sum(counts.values())
    span = max(options.duration, 4.0)

    def later(low: float = 2.0) -> float:
        return round(rng.uniform(low, span), 2)

    specs: list[TaskSpec] = []
    kwargs: dict[str, Any]
    for kind, _, _ in KINDS:
        for i in range(counts[kind]):
            name = f"{kind}-{i:04d}"
            if kind == "timer":
                spec = TaskSpec(
                    name, kind, f"{EXAMPLES}.WaitOperator", {"seconds": later()}, "success"
                )
            elif kind == "multi":
                waits = [round(rng.uniform(0.5, span / 4), 2) for _ in range(3)]
                spec = TaskSpec(
                    name, kind, f"{EXAMPLES}.MultiWaitOperator", {"waits": waits}, "success"
                )
            elif kind == "end_from_trigger":
                kwargs = {"seconds": later(), "end_from_trigger": True}
                spec = TaskSpec(name, kind, f"{EXAMPLES}.WaitOperator", kwargs, "success")
            elif kind == "start_from_trigger":
                kwargs = {"seconds": later()}
                spec = TaskSpec(
                    name, kind, f"{EXAMPLES}.StartFromTriggerWaitOperator", kwargs, "success"
                )
            elif kind == "timeout":
                kwargs = {"seconds": 3600, "timeout": round(rng.uniform(2.0, span * 0.6), 2)}
                spec = TaskSpec(name, kind, f"{EXAMPLES}.WaitOperator", kwargs, "failed")
            elif kind == "file":
                kwargs = {
                    "filepath": str(files / f"{name}.done"),
                    "deferrable": True,
                    "poke_interval": 1.0,
                }
                spec = TaskSpec(name, kind, f"{EXAMPLES}.FileSensor", kwargs, "success", later())
            elif kind == "http":
                kwargs = {
                    "url": f"{http_base}/jobs/{name}",
                    "deferrable": True,
                    "poke_interval": 1.5,
                }
                spec = TaskSpec(name, kind, f"{EXAMPLES}.HttpSensor", kwargs, "success", later())
            else:
                kwargs = {"topic": signals_topic, "match": {"job": name}}
                spec = TaskSpec(
                    name, kind, f"{EXAMPLES}.KafkaMessageOperator", kwargs, "success", later()
                )
            specs.append(spec)
    rng.shuffle(specs)
    return specs
