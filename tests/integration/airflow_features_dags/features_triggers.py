"""The trigger of the bridge's feature tests, importable by Airflow's workers and scheduler
(from the DAGs folder) and by the deferline triggerers (on their PYTHONPATH)."""

# mypy: ignore-errors
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TaskSuccessEvent, TriggerEvent


class FireAfter(BaseTrigger):
    """Fires ``payload`` after ``delay`` seconds; with ``end_from_trigger``, ends its task
    instead (``TaskSuccessEvent`` pushing ``payload`` as the XCom ``fired``)."""

    def __init__(self, delay: float, payload: str, end_from_trigger: bool = False) -> None:
        super().__init__()
        self.delay = delay
        self.payload = payload
        self.end_from_trigger = end_from_trigger

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.FireAfter", {
            "delay": self.delay,
            "payload": self.payload,
            "end_from_trigger": self.end_from_trigger,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        if self.end_from_trigger:
            yield TaskSuccessEvent(xcoms={"fired": self.payload})
        else:
            yield TriggerEvent(self.payload)
