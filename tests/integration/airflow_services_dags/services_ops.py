"""Operators of the Airflow services test's DAGs."""

# mypy: ignore-errors
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator, HITLOperator
from airflow.providers.standard.triggers.hitl import HITLTrigger
from airflow.sdk import BaseOperator
from airflow.sdk.execution_time.hitl import upsert_hitl_detail
from airflow.sdk.timezone import utcnow
from services_triggers import PollsVariable

# The file whose creation lets the gated tasks end (the deployment's environment names it).
GATE_ENV = "SERVICES_TEST_GATE"


class WaitsForGate(BaseOperator):
    """Runs on a worker until the test creates the gate file, then succeeds: the test decides
    when the task another DAG waits for is done."""

    def execute(self, context: Any) -> str:
        gate = Path(os.environ[GATE_ENV])
        deadline = time.monotonic() + 300
        while not gate.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gate {gate} was not opened within 300 s")
            time.sleep(0.2)
        return "gate opened"


class PollsVariableForever(BaseOperator):
    """Defers on ``PollsVariable`` waiting for a value the variable never takes."""

    def __init__(self, *, key: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key = key

    def execute(self, context: Any) -> None:
        trigger = PollsVariable(self.key, until="a value it never takes", interval=1)
        self.defer(trigger=trigger, method_name="execute_complete")

    def execute_complete(self, context: Any, event: Any = None) -> None:
        raise RuntimeError(f"the variable never takes this value, yet the trigger fired: {event!r}")


class DefersOnHITLTrigger:
    """``HITLOperator.execute`` as the standard provider runs it before Airflow 3.3: write the
    human-in-the-loop request, then defer on ``HITLTrigger`` (GetHITLDetailResponse each poke;
    at the timeout, UpdateHITLDetail with the defaults). On 3.3 the provider parks the task in
    ``awaiting_input`` instead, with no trigger at all. Mixed into the provider's operators,
    whose ``execute_complete`` handles the trigger's event."""

    def execute(self, context: Any) -> None:
        ti_id = context["task_instance"].id
        upsert_hitl_detail(
            ti_id=ti_id,
            options=self.options,
            subject=self.subject,
            body=self.body,
            defaults=self.defaults,
            multiple=self.multiple,
            params=self.serialized_params,
            assigned_users=self.assigned_users,
        )
        timeout = utcnow() + self.response_timeout if self.response_timeout else None
        trigger = HITLTrigger(
            ti_id=ti_id,
            options=self.options,
            defaults=self.defaults,
            params=self.serialized_params,
            multiple=self.multiple,
            timeout_datetime=timeout,
            poke_interval=1,
        )
        self.defer(trigger=trigger, method_name="execute_complete")


class ApprovalOnTrigger(DefersOnHITLTrigger, ApprovalOperator):
    """``ApprovalOperator`` (Approve / Reject) waiting on ``HITLTrigger``."""


class HITLOnTrigger(DefersOnHITLTrigger, HITLOperator):
    """``HITLOperator`` waiting on ``HITLTrigger``."""
