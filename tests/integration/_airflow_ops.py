"""deferline operators that defer on Apache Airflow's own trigger classes, unmodified.

Imported by the worker only (through its operator allowlist), after the loader has prepared
Airflow's import; the triggers run in a ``deferline triggerer`` process. Either Airflow line:
the built-in triggers come from the standard provider on Airflow 3, from core on 2.10.
``GreetingTrigger`` is a user's own trigger, written against Airflow's ``BaseTrigger``;
``ExternalJobTrigger`` one with an ``on_kill()``; ``LateDateTimeTrigger`` a user's subclass
of Airflow's ``DateTimeTrigger``.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import pickle
from collections.abc import AsyncIterator
from typing import Any

from airflow.providers.http.triggers.http import HttpSensorTrigger, HttpTrigger
from airflow.triggers.base import BaseTrigger, TaskSuccessEvent, TriggerEvent
from deferline.engine import BaseOperator, Context
from deferline.schemas import utcnow

try:  # Airflow 3
    from airflow.providers.http.triggers.http import HttpResponseSerializer
    from airflow.providers.standard.triggers.external_task import WorkflowTrigger
    from airflow.providers.standard.triggers.file import FileTrigger
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger, TimeDeltaTrigger
    from airflow.sdk import Variable
except ImportError:  # Airflow 2.10
    from airflow.models import Variable
    from airflow.triggers.external_task import WorkflowTrigger
    from airflow.triggers.file import FileTrigger
    from airflow.triggers.temporal import DateTimeTrigger, TimeDeltaTrigger

    HttpResponseSerializer = None

MODULE = __name__
HTTP_CONN_ID = "deferline_test_api"
GREETING_VAR = "deferline_test_greeting"


def http_response(serialized: Any) -> Any:
    """The ``requests.Response`` in HttpTrigger's event (a dict on Airflow 3, a pickle before)."""
    if HttpResponseSerializer is not None:
        return HttpResponseSerializer.deserialize(serialized)
    return pickle.loads(base64.standard_b64decode(serialized))


class GreetingTrigger(BaseTrigger):  # type: ignore[misc]  # Airflow is typed Any here
    """A user's trigger: reads an Airflow variable (a sync call, in the event loop) and fires
    with it, or ends the task with it as an XCom."""

    def __init__(self, key: str, end_from_trigger: bool = False) -> None:
        super().__init__()
        self.key = key
        self.end_from_trigger = end_from_trigger

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{MODULE}.GreetingTrigger",
            {"key": self.key, "end_from_trigger": self.end_from_trigger},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        greeting = Variable.get(self.key)
        self.log.info("read variable %s", self.key)
        if self.end_from_trigger:
            yield TaskSuccessEvent(xcoms={"greeting": greeting})
        else:
            yield TriggerEvent({"greeting": greeting})


def _note(journal: str, line: str) -> None:
    with open(journal, "a") as file:
        file.write(line + "\n")


class ExternalJobTrigger(BaseTrigger):  # type: ignore[misc]
    """A user's trigger watching an external job it started; ``on_kill()`` (Airflow 3.3's hook)
    stops the job. Each hook notes itself in ``journal``, a file the test reads."""

    def __init__(self, journal: str) -> None:
        super().__init__()
        self.journal = journal

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{MODULE}.ExternalJobTrigger", {"journal": self.journal})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        _note(self.journal, "run")
        await asyncio.sleep(3600)  # the job runs
        yield TriggerEvent("job done")

    async def on_kill(self) -> None:
        _note(self.journal, "on_kill")

    async def cleanup(self) -> None:
        _note(self.journal, "cleanup")


class LateDateTimeTrigger(DateTimeTrigger):  # type: ignore[misc]
    """A DateTimeTrigger with a run() of its own: it must run as one, not as a timer."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent("late")


class WaitUntil(BaseOperator):
    """DateTimeTrigger: resumes with the moment as its event."""

    def __init__(self, *, seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context: Context) -> Any:
        moment = utcnow() + dt.timedelta(seconds=self.seconds)
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
        moment = utcnow() + dt.timedelta(seconds=0.2)
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
        response = http_response(event["response"])
        return {"status": event["status"], "code": response.status_code, "json": response.json()}


class Greets(BaseOperator):
    """GreetingTrigger: resumes with the variable's value."""

    def execute(self, context: Context) -> Any:
        self.defer(trigger=GreetingTrigger(GREETING_VAR), method_name="done")

    def done(self, context: Context, event: Any = None) -> Any:
        return {"event": event}


class EndsWithGreeting(BaseOperator):
    """GreetingTrigger with ``end_from_trigger``: a TaskSuccessEvent carrying an XCom."""

    end_from_trigger = True

    def execute(self, context: Context) -> Any:
        self.defer(trigger=GreetingTrigger(GREETING_VAR, end_from_trigger=True), method_name=None)


class WatchesExternalJob(BaseOperator):
    """ExternalJobTrigger: cleared while it waits."""

    def __init__(self, *, journal: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.journal = journal

    def execute(self, context: Context) -> Any:
        self.defer(trigger=ExternalJobTrigger(self.journal), method_name="done")

    def done(self, context: Context, event: Any = None) -> Any:
        raise AssertionError("never resumed: cleared")


class WaitForOtherDag(BaseOperator):
    """WorkflowTrigger: queries Airflow's task instances, so it needs Airflow's database."""

    def execute(self, context: Context) -> Any:
        trigger = WorkflowTrigger(
            external_dag_id="other",
            execution_dates=[utcnow()],
            external_task_ids=["t"],
            allowed_states=["success"],
            poke_interval=0.1,
        )
        self.defer(trigger=trigger, method_name="done")

    def done(self, context: Context, event: Any = None) -> Any:
        raise AssertionError("never resumed normally")
