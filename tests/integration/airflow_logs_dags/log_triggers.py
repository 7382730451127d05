"""A trigger that logs while it waits (a secret among its lines), for the trigger-logs test."""

# mypy: ignore-errors
from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from airflow.sdk.log import mask_secret
from airflow.triggers.base import BaseTrigger, TriggerEvent

SECRET = "hunter2-do-not-log"


class ChattyTrigger(BaseTrigger):
    """Logs a numbered line every 0.2 s until ``release`` exists, then fires."""

    def __init__(self, release: str, name: str) -> None:
        super().__init__()
        self.release = release
        self.name = name

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "log_triggers.ChattyTrigger", {"release": self.release, "name": self.name}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        mask_secret(SECRET)
        self.log.info("chatty %s starts with the password %s", self.name, SECRET)
        line = 0
        while not await asyncio.to_thread(os.path.exists, self.release):
            line += 1
            self.log.info("chatty %s line %d", self.name, line)
            await asyncio.sleep(0.2)
        self.log.warning("chatty %s released after %d lines", self.name, line)
        yield TriggerEvent({"lines": line})
