"""Operators of the bridge's feature tests' DAGs."""

# mypy: ignore-errors
from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator
from airflow.triggers.base import StartTriggerArgs
from features_triggers import FireAfter

# No trigger fires sooner than this after a worker deferred its task: Airflow's scheduler
# fails a task resumed and running again before it has read the executor's report of the
# run that deferred (docs/airflow.md).
RESUME_AFTER = 15


class DefersFromWorker(BaseOperator):
    """Runs on a worker, defers on ``FireAfter``, returns the event as its XCom.

    ``delay`` may be shorter than ``RESUME_AFTER`` for a task whose trigger cannot start
    before the scheduler has long read the report of the run that deferred.
    """

    def __init__(self, *, delay: float = RESUME_AFTER, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay = delay

    def execute(self, context: Any) -> None:
        payload = f"fired for {self.task_id}"
        self.defer(trigger=FireAfter(self.delay, payload), method_name="execute_complete")

    def execute_complete(self, context: Any, event: Any = None) -> str:
        return event


class StartsFromTrigger(BaseOperator):
    """Airflow's documented way to start in the triggerer: ``start_trigger_args`` and
    ``start_from_trigger = True``. The scheduler defers it; ``execute`` never runs."""

    start_from_trigger = True

    def __init__(self, *, end_from_trigger: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_trigger_args = StartTriggerArgs(
            trigger_cls="features_triggers.FireAfter",
            trigger_kwargs={
                "delay": 3,
                "payload": f"started in the trigger for {kwargs['task_id']}",
                "end_from_trigger": end_from_trigger,
            },
            next_method="execute_complete",
            next_kwargs={"note": "from start_trigger_args"},
            timeout=None,
        )

    def execute(self, context: Any) -> None:
        raise RuntimeError("start_from_trigger: execute must not run on a worker")

    def execute_complete(self, context: Any, event: Any = None, note: str = "") -> str:
        return f"{event} | {note}"
