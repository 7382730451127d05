"""SourceOffsets: which offset of a watched topic may be committed, outside transactions."""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition
from deferline.engine import SourcePosition
from deferline.runners.triggerer.testing import SourceOffsets
from deferline.topics import Settings

TP = TopicPartition("orders", 0)


def at(offset: int, partition: int = 0) -> SourcePosition:
    return SourcePosition("g", "orders", partition, offset)


class Recording(SourceOffsets):
    def __init__(self) -> None:
        super().__init__(Settings(bootstrap_servers="x:1"), interval=3600)
        self.sent: list[tuple[str, dict[TopicPartition, int]]] = []

    async def _commit(self, group: str, offsets: dict[TopicPartition, Any]) -> None:
        self.sent.append((group, dict(offsets)))


async def test_an_offset_is_committed_only_once_every_earlier_one_is_out() -> None:
    sources = Recording()
    for offset in (3, 4, 5):
        sources.submitted(at(offset))
    sources.done(at(5))  # acked first, 3 and 4 still on their way (being retried, say)
    sources.done(at(4))
    await sources.commit()
    assert sources.sent == [], "3 holds the commit point back"
    sources.done(at(3))
    await sources.commit()
    assert sources.sent == [("g", {TP: 6})]
    await sources.commit()
    assert sources.sent == [("g", {TP: 6})], "nothing moved: nothing sent"
    await sources.close()


async def test_a_record_read_again_never_moves_the_commit_point_back() -> None:
    sources = Recording()
    sources.submitted(at(8))
    sources.submitted(at(2))  # a later run read an older record again
    sources.done(at(8))
    sources.done(at(2))
    await sources.commit()
    assert sources.sent == [("g", {TP: 9})]
    await sources.close()


async def test_a_failed_commit_is_tried_again() -> None:
    class Failing(Recording):
        fail = True

        async def _commit(self, group: str, offsets: dict[TopicPartition, Any]) -> None:
            if self.fail:
                self.fail = False
                raise ConnectionError("broker away")
            await super()._commit(group, offsets)

    sources = Failing()
    sources.submitted(at(0))
    sources.done(at(0))
    await sources.commit()
    assert sources.sent == []
    await sources.commit()
    assert sources.sent == [("g", {TP: 1})]
    await sources.close()
