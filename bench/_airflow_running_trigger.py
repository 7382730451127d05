"""Airflow's DateTimeTrigger with a ``run()`` of its own: it runs as a coroutine (one task
iterating ``run()``, as every Airflow trigger but the date-time ones), not as a timer."""

# mypy: ignore-errors
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

try:
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger
except ImportError:  # Airflow 2.10
    from airflow.triggers.temporal import DateTimeTrigger


class RunningDateTimeTrigger(DateTimeTrigger):
    """Sleeps until its moment in Airflow's own steps, then fires, asking Airflow nothing."""

    async def run(self) -> AsyncIterator[Any]:
        async for event in super().run():
            yield event
