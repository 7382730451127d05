"""Trigger classes of the bridge's test DAG, importable by Airflow's workers (from the DAGs
folder) and by the deferline triggerer (on its PYTHONPATH)."""

# mypy: ignore-errors
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class FailingTrigger(BaseTrigger):
    """Raises after ``delay`` seconds: its task must fail with Airflow's "Trigger failure"."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.FailingTrigger", {"delay": self.delay}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay)
        raise RuntimeError("the bridge test's trigger fails on purpose")
        yield  # an async generator


class WaitForeverTrigger(BaseTrigger):
    """Never fires; ``on_kill`` (Airflow 3.3+) writes ``marker`` when its task is cleared."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.WaitForeverTrigger", {"marker": self.marker}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.Event().wait()
        yield TriggerEvent(None)

    async def on_kill(self) -> None:
        await asyncio.to_thread(Path(self.marker).write_text, str(os.getpid()))


class RenamedTrigger(BaseTrigger):
    """Names a class its module does not have (as after a rename in a deployment)."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.NoSuchTrigger", {}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent("must never run")
