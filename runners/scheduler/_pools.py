"""The pools topic for one scheduler: the pool ledger's reads, and the records to write.

Every scheduler reads the one partition of ``<prefix>scheduler.pools`` from its beginning (it
is compacted and small: a want and a grant per task that holds or waits for slots of a limited
pool) and keeps following it. Each record goes to the task table of the partition it belongs
to, when this scheduler owns that partition, and to the :class:`~deferline.engine.PoolLedger`
when this scheduler owns task partition 0 (the ledger owner). :class:`PoolChannel` owns the
consumer and no producer: it hands back the records to write, and the scheduler puts wants
into the transaction of their task partition and grants into partition 0's, so the ledger
owner is fenced together with partition 0 and needs no election of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from deferline.engine import PoolEntry, PoolLedger, Pools, TaskTable
from deferline.schemas import SchemaError
from deferline.topics import (
    Lifecycle,
    Settings,
    TopicNames,
    make_consumer,
    partition_for,
    start_client,
    stop_client,
)

from ..member import Outgoing
from ._publishing import SchedulerError

__all__ = ["PoolChannel", "PoolRecord"]

logger = logging.getLogger(__name__)

PoolRecord = Outgoing
"""(topic, key, value) of a pools-topic write; value None is a tombstone."""


class PoolChannel(Lifecycle):
    """Reads the pools topic into the owned partitions' tables and, as ledger owner, into the
    ledger; gives back the records to write. Not safe to share between event loops.

    Call order for the scheduler:

    - :meth:`start`, then :meth:`catch_up` before the first drain of any table (so no table
      publishes a want it already has, or misses a grant);
    - :meth:`own` / :meth:`disown` as task partitions are assigned and revoked (a newly owned
      table gets the latest pools records of its tasks at once);
    - :meth:`lead` once this scheduler owns task partition 0 *and* its producer for that
      partition has been initialised (which fences the previous owner's); :meth:`resign`
      when partition 0 is revoked, or when a transaction carrying grants aborted (then
      :meth:`lead` again);
    - :meth:`poll` in the read loop; after each, drain the tables it names;
    - :meth:`want_records` for each table's :meth:`~deferline.engine.TaskTable.take_pool_writes`
      (into that task partition's transaction), :meth:`grant_records` as ledger owner (into
      partition 0's transaction).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        pools: Pools,
        partitions: int,
        consumer: AIOKafkaConsumer | None = None,
        max_records: int = 5000,
        partition_of: Callable[[str], int] | None = None,
    ) -> None:
        """``partitions``: the tasks topic's partition count (a task's partition is Kafka's
        default partitioner over it). ``consumer``: for tests; by default one with no group,
        ``read_committed``, assigned the pools topic's partition 0 by hand.
        ``partition_of``: the task partition of a key (the scheduler passes its router's,
        which remembers them); by default Kafka's partitioner each time."""
        self.settings = settings
        self.pools = pools
        self.partitions = partitions
        self._partition_of = partition_of
        self.topic = TopicNames(settings.topic_prefix).scheduler_pools
        self.tp = TopicPartition(self.topic, 0)
        self.max_records = max_records
        self.consumer = consumer or make_consumer(settings, group_id=None)
        self.ledger: PoolLedger | None = None
        self.bad_records = 0
        self._tables: dict[int, TaskTable] = {}
        self._latest: dict[str, tuple[int, PoolEntry]] = {}  # key -> (offset, entry), live only
        self._position = 0
        self._ledger_from: int | None = None  # the ledger decides once read up to here
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Assign the pools partition and read it from its beginning."""
        try:
            await start_client(self.consumer, grace=5.0, name="pools consumer")
            self.consumer.assign([self.tp])
            await self.consumer.seek_to_beginning(self.tp)
        except BaseException as exc:  # a start that fails or is cancelled holds connections
            await stop_client(self.consumer, grace=5.0, name="pools consumer")
            if isinstance(exc, KafkaError):
                raise SchedulerError(f"cannot read {self.topic}: {exc}") from exc
            raise
        self._started = True

    async def stop(self) -> None:
        """Stop the consumer (idempotent)."""
        if self._started:
            self._started = False
            await stop_client(self.consumer, grace=5.0, name="pools consumer")

    # -- membership ------------------------------------------------------------------------

    def partition_of(self, ti_key: str) -> int:
        """The task partition of a task instance key."""
        if self._partition_of is not None:
            return self._partition_of(ti_key)
        return partition_for(ti_key.encode(), self.partitions)

    def own(self, partition: int, table: TaskTable) -> None:
        """Route the records of ``partition``'s tasks to ``table`` (in ledger admission),
        starting with the latest record of each of its keys read so far."""
        if table.ledger is None:
            raise ValueError("the table admits locally; build it with LedgerAdmission")
        self._tables[partition] = table
        for _, entry in sorted(self._latest.values(), key=lambda pair: pair[0]):
            if self.partition_of(entry.ti_key) == partition:
                table.apply_pool(entry)

    def disown(self, partition: int) -> None:
        """Stop routing records to a revoked partition's table."""
        self._tables.pop(partition, None)

    @property
    def owned(self) -> set[int]:
        """The task partitions whose tables this channel feeds."""
        return set(self._tables)

    async def lead(self, end: int | None = None) -> None:
        """Become the ledger owner: a ledger rebuilt from what was read, which decides once
        the topic is read to its end as of now (``end``, when the caller read it: see
        :meth:`catch_up`). Call after fencing partition 0's producer."""
        self.ledger = PoolLedger(self.pools)
        for offset, entry in sorted(self._latest.values(), key=lambda pair: pair[0]):
            self.ledger.apply(entry, offset=offset)
        self._ledger_from = await self._end() if end is None else end
        logger.info("pool ledger taken over", extra={"topic": self.topic, "end": self._ledger_from})

    def resign(self) -> None:
        """Stop being the ledger owner (partition 0 revoked, or its grants not committed)."""
        self.ledger = None
        self._ledger_from = None

    @property
    def leading(self) -> bool:
        """True when this channel's ledger may decide (owner, and read up to its takeover)."""
        return (
            self.ledger is not None
            and self._ledger_from is not None
            and self._position >= self._ledger_from
        )

    # -- reading ---------------------------------------------------------------------------

    async def poll(self, timeout_ms: int = 100) -> set[int]:
        """Read what is there (waiting up to ``timeout_ms``); returns the owned partitions
        whose tables got records (drain them)."""
        try:
            batches = await self.consumer.getmany(
                self.tp, timeout_ms=timeout_ms, max_records=self.max_records
            )
        except KafkaError as exc:
            raise SchedulerError(f"cannot read {self.topic}: {exc}") from exc
        touched: set[int] = set()
        for message in batches.get(self.tp, ()):
            partition = self.fold(message.offset, message.key, message.value)
            if partition is not None:
                touched.add(partition)
        self._position = await self._consumer_position()
        return touched

    @property
    def position(self) -> int:
        """The offset read up to: every record below it is folded."""
        return self._position

    async def catch_up(self, timeout_ms: int = 100, *, end: int | None = None) -> set[int]:
        """Read up to the topic's end as of now; returns the tables that got records.

        ``end``: that end, read by the caller with a client that is not fetching. Asked on
        this channel's connection, it waits behind a fetch the broker holds there (a broker
        answers a connection's requests in order): up to ``fetch_max_wait_ms`` on Apache
        Kafka when nothing new is written."""
        if end is None:
            end = await self._end()
        touched: set[int] = set()
        while self._position < end:
            touched |= await self.poll(timeout_ms)
        return touched

    def fold(self, offset: int, key: bytes | None, value: bytes | None) -> int | None:
        """Fold one pools-topic message (what :meth:`poll` does with each); returns the owned
        partition whose table got it, if any."""
        try:
            entry = PoolEntry.read(key, value)
        except SchemaError as exc:
            self.bad_records += 1
            logger.warning(
                "unreadable pools record skipped: %s",
                exc,
                extra={"topic": self.topic, "offset": offset},
            )
            return None
        self._position = max(self._position, offset + 1)
        if entry.value is None:
            self._latest.pop(entry.key, None)
        else:
            self._latest[entry.key] = (offset, entry)
        if self.ledger is not None:
            self.ledger.apply(entry, offset=offset)
        partition = self.partition_of(entry.ti_key)
        table = self._tables.get(partition)
        if table is None:
            return None
        table.apply_pool(entry)
        return partition

    # -- writing ---------------------------------------------------------------------------

    def want_records(self, entries: list[PoolEntry]) -> list[PoolRecord]:
        """A table's wants and want tombstones as records, in order (for the transaction of
        the task partition whose table decided them)."""
        return [self._record(entry) for entry in entries]

    def grant_records(self) -> list[PoolRecord]:
        """The ledger's grants and grant tombstones to write in partition 0's transaction;
        empty unless :attr:`leading`. If that transaction aborts, :meth:`resign` and
        :meth:`lead` again: the ledger counted grants the topic does not hold."""
        if not self.leading:
            return []
        assert self.ledger is not None
        return [self._record(entry) for entry in self.ledger.decide()]

    # -- metrics ---------------------------------------------------------------------------

    def usage(self) -> dict[str, tuple[int, int | None]]:
        """Slots granted and pool size per limited pool, as the ledger owner counts them;
        from the grants read when this scheduler is not the owner."""
        if self.ledger is not None:
            return self.ledger.usage()
        used: dict[str, int] = {}
        for _, entry in self._latest.values():
            if entry.kind == "grant" and entry.value is not None:
                used[entry.value.pool] = used.get(entry.value.pool, 0) + entry.value.slots
        names = set(self.pools.slots) | set(used)
        return {name: (used.get(name, 0), self.pools.size(name)) for name in sorted(names)}

    def waiting(self) -> dict[str, int]:
        """Wants without a matching grant, per pool (from the topic when not the owner)."""
        if self.ledger is not None:
            return self.ledger.waiting()
        view = PoolLedger(self.pools)
        for _, entry in self._latest.values():
            view.apply(entry)
        return view.waiting()

    # -- internals -------------------------------------------------------------------------

    def _record(self, entry: PoolEntry) -> PoolRecord:
        return (self.topic, entry.key.encode(), entry.encode())

    async def _end(self) -> int:
        try:
            ends = await self.consumer.end_offsets([self.tp])
        except KafkaError as exc:
            raise SchedulerError(f"cannot read the end of {self.topic}: {exc}") from exc
        return int(ends[self.tp])

    async def _consumer_position(self) -> int:
        try:
            return int(await self.consumer.position(self.tp))
        except KafkaError as exc:
            raise SchedulerError(f"cannot read the position on {self.topic}: {exc}") from exc
