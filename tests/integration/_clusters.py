"""Test helper: a second, fresh broker of the backend under test (another cluster)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from deferline.topics import KRaftBroker, Settings, TansuBroker, make_admin

from ._util import wait_until


@contextlib.asynccontextmanager
async def another_cluster(backend: str, settings: Settings) -> AsyncIterator[Settings]:
    """``settings`` (same topic prefix, so the same topic names) on a new broker of
    ``backend``, stopped on exit."""
    if backend not in ("tansu", "kafka"):
        pytest.skip(f"the test starts a second {backend} broker itself: tansu or kafka only")
    broker: TansuBroker | KRaftBroker = (
        TansuBroker() if backend == "tansu" else KRaftBroker(heap="384m")
    )
    async with broker:
        yield settings.model_copy(update={"bootstrap_servers": broker.bootstrap})


async def delete_topic(settings: Settings, topic: str) -> None:
    """Delete ``topic`` and wait until the cluster no longer lists it."""
    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.delete_topics([topic])

        async def gone() -> bool:
            return topic not in await admin.list_topics()

        await wait_until(gone, 30, message=f"{topic} is deleted")
    finally:
        await admin.close()
