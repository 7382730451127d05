"""deferline operators that defer on Apache Airflow's own trigger classes, unmodified.

Imported by the worker only (through its operator allowlist), after the loader has prepared
Airflow's import; the triggers run in a ``deferline triggerer`` process.
"""

from __future__ import annotations

import base64
import datetime as dt
import pickle
from typing import Any

from airflow.providers.http.triggers.http import HttpSensorTrigger, HttpTrigger
from airflow.triggers.external_task import WorkflowTrigger
from airflow.triggers.file import FileTrigger
from airflow.triggers.temporal import DateTimeTrigger, TimeDeltaTrigger
from airflow.utils import timezone
from deferline.engine import BaseOperator, Context

MODULE = __name__
HTTP_CONN_ID = "deferline_test_api"


class WaitUntil(BaseOperator):
    """DateTimeTrigger: resumes with the moment as its event."""

    def __init__(self, *, seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context: Context) -> Any:
        moment = timezone.utcnow() + dt.timedelta(seconds=self.seconds)
        self.defer(trigger=DateTimeTrigger(moment), method_name="done", kwargs={"moment": moment})

    def done(self, context: Context, event: Any, moment: dt.datetime) -> Any:
        return {"event": event, "moment": moment}


class WaitFor(BaseOperator):
    """TimeDeltaTrigger (Airflow's own example of deferring)."""

    def __init__(self, *, seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context: Context) -> Any:
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=self.seconds)), method_name="done")

    def done(self, context: Context, event: Any = None) -> Any:
        return {"event": event}


class EndsFromTrigger(BaseOperator):
    """DateTimeTrigger with ``end_from_trigger``: Airflow's TaskSuccessEvent ends the task."""

    end_from_trigger = True

    def execute(self, context: Context) -> Any:
        moment = timezone.utcnow() + dt.timedelta(seconds=0.2)
        self.defer(trigger=DateTimeTrigger(moment, end_from_trigger=True), method_name=None)


class WaitForFile(BaseOperator):
    """FileTrigger: resumes with ``True`` once the file exists."""

    def __init__(self, *, path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def execute(self, context: Context) -> Any:
        self.defer(trigger=FileTrigger(self.path, poke_interval=0.1), method_name="done")

    def done(self, context: Context, event: Any = None) -> Any:
        return {"event": event}


class WaitForEndpoint(BaseOperator):
    """HttpSensorTrigger: resumes with ``True`` once the endpoint stops answering 404."""

    def execute(self, context: Context) -> Any:
        trigger = HttpSensorTrigger(endpoint="ready", http_conn_id=HTTP_CONN_ID, poke_interval=0.1)
        self.defer(trigger=trigger, method_name="done")

    def done(self, context: Context, event: Any = None) -> Any:
        return {"event": event}


class CallEndpoint(BaseOperator):
    """HttpTrigger: resumes with Airflow's ``{"status", "response"}`` (a pickled Response)."""

    def execute(self, context: Context) -> Any:
        trigger = HttpTrigger(http_conn_id=HTTP_CONN_ID, method="GET", endpoint="data")
        self.defer(trigger=trigger, method_name="done")

    def done(self, context: Context, event: Any = None) -> Any:
        response = pickle.loads(base64.standard_b64decode(event["response"]))
        return {"status": event["status"], "code": response.status_code, "json": response.json()}


class WaitForOtherDag(BaseOperator):
    """WorkflowTrigger: queries Airflow's task instances, so it needs Airflow's database."""

    def execute(self, context: Context) -> Any:
        trigger = WorkflowTrigger(
            external_dag_id="other",
            execution_dates=[timezone.utcnow()],
            external_task_ids=["t"],
            allowed_states=["success"],
            poke_interval=0.1,
        )
        self.defer(trigger=trigger, method_name="done")

    def done(self, context: Context, event: Any = None) -> Any:
        raise AssertionError("never resumed normally")
