# mypy: ignore-errors
"""A trigger class outside the prefixes deferline is allowed to load."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class ForbiddenTrigger(BaseTrigger):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.ForbiddenTrigger", {}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent("must never run")
