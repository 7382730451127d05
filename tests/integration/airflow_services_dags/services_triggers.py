"""The user triggers of the Airflow services tests: they ask Airflow's runtime for a variable
or a connection stored only in Airflow's database. Importable by Airflow's workers (from the
DAGs folder) and by the deferline triggerer (on its PYTHONPATH), on either Airflow line."""

# mypy: ignore-errors
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

try:  # Airflow 3
    from airflow.sdk import BaseHook, Variable
except ImportError:  # Airflow 2.10
    from airflow.hooks.base import BaseHook
    from airflow.models import Variable


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
