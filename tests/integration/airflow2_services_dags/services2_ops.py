"""Operators of the Airflow 2.10 services test's DAGs."""

# mypy: ignore-errors
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from airflow.models import BaseOperator, Variable
from airflow.sensors.python import PythonSensor
from services_triggers import ConnectionAfter, VariableAfter

# No trigger fires sooner than this after its task deferred: Airflow's scheduler fails a task
# resumed and running again before it has read the executor's report of the run that deferred
# (docs/airflow.md).
RESUME_AFTER = 15
# The file whose creation lets the gated tasks end (the deployment's environment names it).
GATE_ENV = "SERVICES_TEST_GATE"


def waits_for_gate(task_id: str) -> PythonSensor:
    """Succeeds once the test creates the gate file. It pokes in reschedule mode: 2.10's
    SequentialExecutor runs one task at a time, and a task waiting in place would hold it."""
    return PythonSensor(
        task_id=task_id,
        python_callable=lambda: Path(os.environ[GATE_ENV]).exists(),
        mode="reschedule",
        poke_interval=1,
        timeout=300,
    )


class ReadsVariable(BaseOperator):
    """Defers on ``VariableAfter``; resumed, checks the trigger's value against the one
    Airflow's worker reads and returns it as its XCom."""

    def __init__(self, *, key: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key = key

    def execute(self, context: Any) -> None:
        self.defer(trigger=VariableAfter(self.key, RESUME_AFTER), method_name="execute_complete")

    def execute_complete(self, context: Any, event: Any = None) -> str:
        expected = Variable.get(self.key)
        if event != {"key": self.key, "value": expected}:
            raise ValueError(f"the trigger read {event!r}; Airflow has {expected!r}")
        return event["value"]


class ReadsConnection(BaseOperator):
    """Defers on ``ConnectionAfter``; resumed, returns the connection's host."""

    def __init__(self, *, conn_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.conn_id = conn_id

    def execute(self, context: Any) -> None:
        trigger = ConnectionAfter(self.conn_id, RESUME_AFTER)
        self.defer(trigger=trigger, method_name="execute_complete")

    def execute_complete(self, context: Any, event: Any = None) -> str:
        return event["host"]
