"""A checkpoint store that fails never stops the lane, and never fails quietly either; a
partition another process holds is rebuilt from the topics."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiokafka import TopicPartition
from deferline.runners.triggerer.testing import (
    Checkpointer,
    CheckpointError,
    MemoryCheckpointStore,
    OwnedPartition,
    RocksCheckpointStore,
    Span,
    TableChanges,
    TriggererMetrics,
)
from prometheus_client import CollectorRegistry


class FailingStore(MemoryCheckpointStore):
    """Every write and release fails as a broken disk would."""

    def write(self, topic: str, partition: int, changes: TableChanges) -> None:
        raise CheckpointError("disk full")

    def release(self, topic: str, partition: int) -> None:
        raise CheckpointError("cannot close")


def failures(registry: CollectorRegistry, action: str) -> float:
    value = registry.get_sample_value(
        "deferline_triggerer_checkpoint_failures_total", {"action": action}
    )
    return value or 0.0


async def test_store_failures_are_logged_and_counted_and_the_changes_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    checkpointer = Checkpointer(
        FailingStore(),
        topic="p.defer",
        max_age=3600.0,
        metrics=TriggererMetrics(registry),
        log=lambda part=None, **fields: {"partition": part, **fields},
    )
    part = OwnedPartition(
        number=0, defer_tp=TopicPartition("p.defer", 0), resume_tp=TopicPartition("p.resume", 0)
    )
    part.table.apply(b"a", b"a0", offset=0)

    await checkpointer.save(part, rebuilt=True)
    await checkpointer.release(0)

    assert failures(registry, "write") == 1
    assert failures(registry, "release") == 1
    assert "checkpoint failed" in caplog.text
    assert "checkpoint release failed" in caplog.text
    assert part.saved.positions is None, "nothing was saved"
    assert not part.table.take_changes().empty, "the unsaved change is written next time"


async def test_triggerers_on_one_host_share_the_default_state_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each partition's database is locked on its own: a second process's partition that the
    first holds is rebuilt from the topics (said once), its other partitions checkpoint."""
    stores = [RocksCheckpointStore(tmp_path) for _ in range(2)]
    first, second = (
        Checkpointer(
            store,
            topic="p.defer",
            max_age=3600.0,
            metrics=TriggererMetrics(CollectorRegistry()),
            log=lambda part=None, **fields: {"partition": part, **fields},
        )
        for store in stores
    )
    span = Span(begin=0, end=0)
    try:
        assert await first.restore(_part(0), span, span) is None  # opens (and locks) it
        held, free = _part(0), _part(1)
        assert await second.restore(held, span, span) is None
        assert not held.saved.enabled, "rebuilt from the topics, never checkpointed here"
        assert "checkpoint unavailable; rebuilding from the topic" in caplog.text
        assert await second.restore(free, span, span) is None
        assert free.saved.enabled
        free.table.apply(b"a", b"a0", offset=0)
        await second.save(free, rebuilt=True)
        assert free.saved.positions is not None, "the partition it holds is checkpointed"
    finally:
        for store in stores:
            store.close()


def _part(number: int) -> OwnedPartition:
    return OwnedPartition(
        number=number,
        defer_tp=TopicPartition("p.defer", number),
        resume_tp=TopicPartition("p.resume", number),
    )
