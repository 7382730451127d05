"""The user triggers of the Airflow services tests, and the operators deferring on them:
they ask Airflow's runtime for a variable or a connection stored only in Airflow's database.
Importable by Airflow's workers (from the DAGs folder) and by the deferline triggerer (on its
PYTHONPATH), on either Airflow line."""

# mypy: ignore-errors
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

try:  # Airflow 3
    from airflow.sdk import BaseHook, BaseOperator, Variable
except ImportError:  # Airflow 2.10
    from airflow.hooks.base import BaseHook
    from airflow.models import BaseOperator, Variable

# No trigger fires sooner than this after its task deferred: Airflow's scheduler fails a task
# resumed and running again before it has read the executor's report of the run that deferred
# (docs/airflow.md).
RESUME_AFTER = 15


class VariableAfter(BaseTrigger):
    """After ``delay`` seconds, reads the variable ``key`` with a sync ``Variable.get`` made
    inside ``run()`` (on the event loop, as many users' triggers do) and fires with it."""

    def __init__(self, key: str, delay: float) -> None:
        super().__init__()
        self.key = key
        self.delay = delay

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.VariableAfter", {"key": self.key, "delay": self.delay}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        value = Variable.get(self.key)
        self.log.info("read variable %s", self.key)
        yield TriggerEvent({"key": self.key, "value": value})


class ConnectionAfter(BaseTrigger):
    """After ``delay`` seconds, reads the connection ``conn_id`` with a sync
    ``BaseHook.get_connection`` inside ``run()`` and fires with its host."""

    def __init__(self, conn_id: str, delay: float) -> None:
        super().__init__()
        self.conn_id = conn_id
        self.delay = delay

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.ConnectionAfter", {"conn_id": self.conn_id, "delay": self.delay}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        connection = BaseHook.get_connection(self.conn_id)
        yield TriggerEvent({"conn_id": self.conn_id, "host": connection.host})


class PollsVariable(BaseTrigger):
    """Reads the variable ``key`` every ``interval`` seconds (a sync ``Variable.get`` inside
    ``run()``) until it equals ``until``, then fires."""

    def __init__(self, key: str, until: str, interval: float) -> None:
        super().__init__()
        self.key = key
        self.until = until
        self.interval = interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.PollsVariable", {
            "key": self.key,
            "until": self.until,
            "interval": self.interval,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            value = Variable.get(self.key)
            self.log.info("polled variable %s", self.key)
            if value == self.until:
                yield TriggerEvent(value)
                return
            await asyncio.sleep(self.interval)


class ReadsVariable(BaseOperator):
    """Defers on ``VariableAfter``; resumed, checks the trigger's value against the one
    Airflow's worker reads (the API server's answer) and returns it as its XCom."""

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
