"""Triggers written for Airflow's trigger contract, copied from Airflow's documentation.

Only the import lines differ from the originals (``airflow.triggers.base`` and
``airflow.sdk.timezone`` became deferline's); the classes are otherwise unchanged.
"""
# ruff: noqa: ASYNC110
# mypy: ignore-errors

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from deferline.engine import BaseTrigger, TaskSuccessEvent, TriggerEvent
from deferline.schemas import utcnow


class DateTimeTrigger(BaseTrigger):
    def __init__(self, moment):
        super().__init__()
        self.moment = moment

    def serialize(self):
        return ("tests.engine.airflow_triggers.DateTimeTrigger", {"moment": self.moment})

    async def run(self):
        while self.moment > utcnow():
            await asyncio.sleep(1)
        yield TriggerEvent(self.moment)


class MyItemTrigger(BaseTrigger):
    def __init__(self, item):
        super().__init__()
        self.item = item

    def serialize(self):
        return (self.__class__.__module__ + "." + self.__class__.__name__, {"item": self.item})

    async def run(self):
        result = None
        try:
            # Somehow process the item to calculate the result
            result = self.item * 2
            yield TriggerEvent({"result": result})
        except Exception as e:
            yield TriggerEvent({"error": str(e)})


class WaitFiveHourTrigger(BaseTrigger):
    def __init__(self, duration: timedelta, *, end_from_trigger: bool = False):
        super().__init__()
        self.duration = duration
        self.end_from_trigger = end_from_trigger

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "tests.engine.airflow_triggers.WaitFiveHourTrigger",
            {"duration": self.duration, "end_from_trigger": self.end_from_trigger},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.duration.total_seconds())
        if self.end_from_trigger:
            yield TaskSuccessEvent()
        else:
            yield TriggerEvent({"duration": self.duration})


class JobStatusTrigger(BaseTrigger):
    """Provider style: poll a service, log progress, close the client in cleanup()."""

    jobs: dict[str, list[str]] = {}
    closed: list[str] = []

    def __init__(self, job_id: str, poll_interval: float = 10.0, **kwargs):
        super().__init__(**kwargs)
        self.job_id = job_id
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{self.__class__.__module__}.{self.__class__.__qualname__}",
            {"job_id": self.job_id, "poll_interval": self.poll_interval},
        )

    async def _get_status(self) -> str:
        await asyncio.sleep(0)
        states = self.jobs[self.job_id]
        return states.pop(0) if len(states) > 1 else states[0]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            while True:
                status = await self._get_status()
                if status == "SUCCEEDED":
                    yield TriggerEvent({"status": "success", "job_id": self.job_id})
                    return
                if status == "FAILED":
                    yield TriggerEvent({"status": "error", "message": f"Job {self.job_id} failed"})
                    return
                self.log.info(
                    "Job %s is %s; sleeping %s seconds", self.job_id, status, self.poll_interval
                )
                await asyncio.sleep(self.poll_interval)
        except Exception as e:
            yield TriggerEvent({"status": "error", "message": str(e)})

    async def cleanup(self) -> None:
        self.closed.append(self.job_id)
