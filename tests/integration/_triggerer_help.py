"""Helpers for triggerer tests against a real broker: requests, event collection, processes."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import re
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from deferline.schemas import (
    AnyRecord,
    DeferRequest,
    ResumeTarget,
    SchemaError,
    TaskKey,
    TriggerEventRecord,
    decode,
    encode,
    make_trigger_id,
    utcnow,
)
from deferline.topics import Settings, TopicNames, make_consumer, partition_for, stop_client

from tests.integration._process import DeferlineProcess

DATETIME = "deferline.engine.triggers.DateTimeTrigger"
FAILOVER_FLAGS = ("--session-timeout-ms", "6000", "--heartbeat-interval-ms", "1000")


def defer_request(
    number: int,
    *,
    due_in: float = 0.0,
    queue: str | None = None,
    run: str = "r",
    classpath: str = DATETIME,
    kwargs: dict[str, Any] | None = None,
    resume: ResumeTarget | None = None,
) -> DeferRequest:
    """A DeferRequest of task number ``number`` whose DateTimeTrigger is due in ``due_in`` s."""
    task = TaskKey(dag_id="dag", task_id="wait", run_id=f"{run}-{number}")
    moment = utcnow() + dt.timedelta(seconds=due_in)
    return DeferRequest(
        trigger_id=make_trigger_id(task, 0),
        task=task,
        classpath=classpath,
        kwargs={"moment": moment} if kwargs is None else kwargs,
        queue=queue,
        resume=resume,
    )


def partition_of(trigger_id: str, partitions: int) -> int:
    """The partition the default partitioner gives this trigger id."""
    return partition_for(trigger_id.encode(), partitions)


async def produce(
    producer: AIOKafkaProducer,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None]],
    *,
    partition: int | None = None,
) -> None:
    """Send many records and wait for all acks together."""
    futures = [
        await producer.send(topic, key=key, value=value, partition=partition)
        for key, value in records
    ]
    await asyncio.gather(*futures)


async def produce_requests(
    producer: AIOKafkaProducer, settings: Settings, requests: Sequence[DeferRequest]
) -> None:
    names = TopicNames(settings.topic_prefix)
    by_topic: dict[str, list[tuple[bytes | None, bytes | None]]] = {}
    for request in requests:
        by_topic.setdefault(names.defer(request.queue), []).append(
            (request.trigger_id.encode(), encode(request))
        )
    for topic, records in by_topic.items():
        await produce(producer, topic, records)


@dataclass
class TopicReader:
    """Reads a topic from the beginning in the background, keeping decoded records."""

    settings: Settings
    topic: str
    records: list[tuple[int, bytes | None, AnyRecord | None]] = field(default_factory=list)
    undecodable: list[bytes] = field(default_factory=list)
    _consumer: AIOKafkaConsumer | None = None
    _task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> TopicReader:
        self._consumer = make_consumer(self.settings, self.topic, group_id=None)
        await self._consumer.start()
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        finally:
            if self._consumer is not None:
                # aiokafka's stop() lets a fetch's CancelledError out when that fetch sleeps
                # in its retry backoff (a broker that closed the connection: a SASL session
                # ending, a broker gone): stop_client closes the connections all the same.
                await stop_client(self._consumer, grace=10.0, name="topic reader")

    async def _read(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=200)
            for tp, batch in batches.items():
                for record in batch:
                    value: AnyRecord | None = None
                    if record.value is not None:
                        try:
                            value = decode(record.value)
                        except SchemaError:
                            self.undecodable.append(record.value)
                            continue
                    self.records.append((tp.partition, record.key, value))

    def values(self) -> list[AnyRecord]:
        return [value for _, _, value in self.records if value is not None]

    def events(self) -> list[TriggerEventRecord]:
        return [v for v in self.values() if isinstance(v, TriggerEventRecord)]

    def tombstones(self) -> set[bytes]:
        return {key for _, key, value in self.records if value is None and key is not None}

    def distinct_triggers(self) -> set[str]:
        return {event.trigger_id for event in self.events()}


# -- triggerer processes ----------------------------------------------------------------------


class TriggererProcess(DeferlineProcess):
    """A ``deferline triggerer`` subprocess with JSON logs captured to a file."""

    def __init__(
        self,
        settings: Settings,
        member: str,
        workdir: Path,
        *extra: str,
    ) -> None:
        self.member = member
        self.state_dir = workdir / f"{member}-state"
        super().__init__(
            settings,
            "triggerer",
            workdir / f"{member}.log",
            "--member",
            member,
            "--state-dir",
            str(self.state_dir),
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
            "--log-format",
            "json",
            "--no-create-topics",
            *extra,
        )
        self.port: int | None = None

    async def metrics(self) -> dict[str, float]:
        """Scrape the process's metrics into ``{name{labels}: value}``."""
        if self.port is None:
            served = self.find("metrics served")
            if not served:
                return {}
            self.port = int(served[0]["port"])
        url = f"http://127.0.0.1:{self.port}/metrics"
        try:
            async with aiohttp.ClientSession() as session, session.get(url) as response:
                text = await response.text()
        except aiohttp.ClientError:
            return {}
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^([^#\s][^\s]*)\s+(\S+)$", line)
            if match:
                values[match.group(1)] = float(match.group(2))
        return values

    async def assigned(self) -> int:
        metrics = await self.metrics()
        return int(
            sum(v for k, v in metrics.items() if k.startswith("deferline_triggerer_assigned_"))
        )

    async def bootstrapped(self) -> bool:
        """True once the member owns partitions and every one of them finished its rebuild."""
        lines = self.lines()
        assigned = [line for line in lines if line.get("message") == "partitions assigned"]
        if not assigned:
            return False
        last = lines.index(assigned[-1])
        done = [
            int(line["partition"])
            for line in lines[last:]
            if line.get("message") == "partition bootstrapped"
        ]
        # Kept partitions are not rebuilt: only the acquired ones log a bootstrap.
        return sorted(done) == sorted(assigned[-1].get("acquired", assigned[-1]["partitions"]))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)


async def owners(processes: Sequence[TriggererProcess]) -> dict[int, str]:
    """Which member owns which partition, from each member's latest assignment log line."""
    result: dict[int, str] = {}
    for process in processes:
        if process.proc.poll() is not None:
            continue
        assigned = process.find("partitions assigned")
        if assigned:
            for number in assigned[-1]["partitions"]:
                result[number] = process.member
    return result


def elapsed_since(start: float) -> float:
    return time.monotonic() - start
