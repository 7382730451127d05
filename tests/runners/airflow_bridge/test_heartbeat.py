"""The bridge's job heartbeat rides out a moment of Airflow's database being busy (SQLite's
"database is locked") as its claim loop does, instead of ending the bridge."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, cast

import pytest
from deferline.runners.airflow_bridge import AirflowBridge
from deferline.topics import Settings

from tests._until import until


class Locked(Exception):
    """What the database raises while another writer holds it."""


class BusyOnce:
    """An Airflow database whose first heartbeat finds it locked."""

    heartrate = 0.0
    transient = Locked

    def __init__(self) -> None:
        self.beats = 0

    def heartbeat(self) -> None:
        self.beats += 1
        if self.beats == 1:
            raise Locked("database is locked")


async def test_a_heartbeat_the_database_refuses_is_logged_and_the_next_one_is_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    db = BusyOnce()
    bridge = AirflowBridge(Settings(bootstrap_servers="unused:1"), database=cast(Any, db))
    bridge.metrics = cast(Any, object())  # started, as far as the heartbeat asks
    with caplog.at_level(logging.WARNING):
        beating = asyncio.create_task(bridge._heartbeat_loop())
        try:
            await until(lambda: db.beats >= 3, within=10, what="heartbeats after the refused one")
            assert not beating.done(), "the refused heartbeat did not end the loop"
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
    assert any("heartbeat: Airflow's database failed" in r.getMessage() for r in caplog.records)
