"""A burst: 20,000 timers due at once through a producer bound a tenth of that, on a real broker.

Ten times the bound is enough to go through it many times on every partition; the
throughput and memory of larger bursts are `bench_triggerer --only burst`'s to measure.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import orjson
import pytest
from deferline.runners.triggerer import Triggerer, TriggererOptions
from deferline.schemas import (
    DeferRequest,
    TaskKey,
    decode_as,
    encode,
    make_trigger_id,
    to_tagged,
)
from deferline.topics import Settings, TopicNames, ensure_topics, topic_specs

from bench._harness import produce_batched
from tests.integration._triggerer_help import DATETIME
from tests.integration._util import KafkaClients

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

N = 20_000
BOUND = 2_000


def _requests(base: dt.datetime) -> list[tuple[bytes, bytes]]:
    """N requests whose moments (all in the past) rise with their number.

    One request goes through the model; the others are its JSON with the task's run id,
    trigger id and moment replaced (building 200,000 models would dominate the test).
    """
    task = TaskKey(dag_id="burst", task_id="wait", run_id="r-0")
    template = DeferRequest(
        trigger_id=make_trigger_id(task, 0),
        task=task,
        classpath=DATETIME,
        kwargs={"moment": base},
    )
    fields = orjson.loads(encode(template))
    out = []
    for number in range(N):
        task = TaskKey(dag_id="burst", task_id="wait", run_id=f"r-{number}")
        trigger_id = make_trigger_id(task, 0)
        fields["trigger_id"] = trigger_id
        fields["task"]["run_id"] = task.run_id
        fields["kwargs"] = to_tagged({"moment": base + dt.timedelta(microseconds=number)})
        out.append((trigger_id.encode(), orjson.dumps(fields)))
    decode_as(out[-1][1], DeferRequest)  # still a valid request
    return out


async def test_a_burst_of_due_timers_arrives_once_each_in_due_order_under_a_small_bound(
    settings: Settings, kafka_clients: KafkaClients, tmp_path: Path
) -> None:
    names = TopicNames(settings.topic_prefix)
    await ensure_topics(settings, topic_specs(settings))
    base = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    records = _requests(base)
    producer = await kafka_clients.producer(linger_ms=5, max_batch_size=512 * 1024)
    await produce_batched(producer, names.defer(), records, settings.partitions)
    expected = {key.decode(): number for number, (key, _) in enumerate(records)}
    del records

    reader = await kafka_clients.consumer(names.resume(), max_partition_fetch_bytes=8 << 20)
    seen: dict[int, list[tuple[int, str]]] = {}
    count = 0
    options = TriggererOptions(
        member="burst",
        state_dir=None,
        capacity=N + 1,
        max_unsent=BOUND,
        session_timeout_ms=6000,
    )
    # Every timer is already due when the member starts: it fires them as it adds them.
    async with Triggerer(settings, options) as triggerer:
        deadline = time.monotonic() + 120
        while count < N and time.monotonic() < deadline:
            batches = await reader.getmany(timeout_ms=500, max_records=50_000)
            for tp, batch in batches.items():
                rows = seen.setdefault(tp.partition, [])
                for record in batch:
                    event = orjson.loads(record.value)
                    rows.append((expected[event["trigger_id"]], event["status"]))
                    count += 1
        peak = triggerer.peak_unsent

    assert count == N, f"{count} of {N} events within the deadline"
    numbers = [number for rows in seen.values() for number, _ in rows]
    assert len(set(numbers)) == N, "every trigger exactly once"
    assert {status for rows in seen.values() for _, status in rows} == {"fired"}
    for partition, rows in seen.items():
        order = [number for number, _ in rows]
        assert order == sorted(order), f"partition {partition} out of due order"
    assert peak <= BOUND + 1, f"{peak} events waited for the producer (bound {BOUND})"
