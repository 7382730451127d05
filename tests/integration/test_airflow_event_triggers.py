"""Airflow 3's triggers that no task waits on, through the bridge, in a real Airflow 3.3
deployment: asset watchers and deadline-alert callbacks.

One deployment (scheduler, DAG processor, API server, LocalExecutor, SQLite), no ``airflow
triggerer``. The DAG ``watched`` is scheduled on an asset watched by Airflow's own
``FileDeleteTrigger``. The bridge publishes the watcher's row as a standing watch; deferline's
triggerers run it; each flag file dropped becomes one asset event and one DAG run, through:

* a triggerer SIGKILLed between two files (the other takes the watch over);
* a bridge frozen while a watcher's event reaches the resume topic, then SIGKILLed (the next
  bridge applies it, once);
* every event read again from the start of the resume topic by a new bridge: each is found
  applied (its id recorded with its asset events) and applied no second time.

The DAG ``deadlined`` misses its deadline (its run is queued 1 s before the deadline, its task
sleeps 20 s): the scheduler queues its two ``AsyncCallback`` alerts, one under the allowed
prefixes (run once in a deferline triggerer: ``running``, then ``success`` with its output),
one outside them (never imported: ``failed``, saying why).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from deferline.schemas import WatchEvent, decode
from deferline.topics import Settings, TopicNames

from tests._until import until
from tests.airflow_line import airflow_version

from ._airflow_deployment import AirflowDeployment
from ._airflow_processes import Processes, run_id_of, trigger_dag
from ._triggerer_help import FAILOVER_FLAGS, produce
from ._util import KafkaClients

pytestmark = [
    pytest.mark.integration,
    pytest.mark.airflow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(airflow_version() < (3, 0), reason="asset watchers are Airflow 3's"),
]

DAGS = Path(__file__).with_name("airflow_event_dags")
HEALTH_THRESHOLD_S = 5


@pytest.fixture(scope="module")
def inbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inbox")


@pytest.fixture(scope="module")
def orders_topic() -> str:
    """The topic the Kafka watcher of ``kafka_watched`` reads (one per module run)."""
    return f"orders-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def airflow(
    tmp_path_factory: pytest.TempPathFactory, inbox: Path, orders_topic: str
) -> Iterator[AirflowDeployment]:
    af = AirflowDeployment(
        tmp_path_factory.mktemp("airflow"),
        extra_env={
            "WATCH_INBOX": str(inbox),
            "WATCH_TOPIC": orders_topic,
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(HEALTH_THRESHOLD_S),
            "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": (
                "airflow.providers.standard.triggers,airflow.triggers.callback,"
                "deadline_callbacks,deferline.engine.triggers"
            ),
            "DEFERLINE_COPY_EVENTS_TO_TASKS": "false",
        },
        dags_from=DAGS,
    )
    try:
        af.start()
        af.wait_for("SELECT 1 FROM trigger t JOIN asset_watcher w ON w.trigger_id = t.id")
        yield af
    finally:
        af.close()


def counts(af: AirflowDeployment) -> tuple[int, int]:
    """Asset events of the watched asset, and runs of the DAG it schedules."""
    [(events,)] = af.query(
        "SELECT count(*) FROM asset_event e JOIN asset a ON a.id = e.asset_id "
        "WHERE a.name = 'watched_inbox'"
    )
    [(runs,)] = af.query("SELECT count(*) FROM dag_run WHERE dag_id = 'watched'")
    return int(str(events)), int(str(runs))


async def drop_and_see(af: AirflowDeployment, inbox: Path, number: int) -> None:
    """Drop the flag file; wait for asset event ``number`` and the DAG run it schedules."""
    (inbox / ".flag").write_text(str(number))
    (inbox / ".flag").rename(inbox / "flag")
    await until(
        partial(asyncio.to_thread, lambda: counts(af) == (number, number)),
        within=120,
        interval=0.3,
        what=lambda: f"asset event and run {number} (events, runs now: {counts(af)})",
    )
    assert not (inbox / "flag").exists()


def watcher_prefix(af: AirflowDeployment, name: str) -> str:
    """The start of the trigger ids the bridge gives the row of asset watcher ``name``
    (``airflow-<row id>-``): the module's other watchers publish on the same topics."""
    [(row,)] = af.wait_for(
        "SELECT t.id FROM trigger t JOIN asset_watcher w ON w.trigger_id = t.id WHERE w.name = ?",
        name,
    )
    return f"airflow-{row}-"


async def watch_events(clients: KafkaClients, topic: str, of: str = "") -> list[WatchEvent]:
    """The WatchEvents on ``topic`` now (read from its start to its end), of the trigger ids
    starting with ``of``."""
    consumer = await clients.consumer()
    await consumer._client.force_metadata_update()
    partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
    consumer.assign(partitions)
    await consumer.seek_to_beginning(*partitions)
    ends = await consumer.end_offsets(partitions)
    found: list[WatchEvent] = []
    while any([await consumer.position(tp) < end for tp, end in ends.items()]):
        batches = await consumer.getmany(*partitions, timeout_ms=500)
        for message in (m for ms in batches.values() for m in ms):
            record = decode(message.value) if message.value is not None else None
            if isinstance(record, WatchEvent) and record.trigger_id.startswith(of):
                found.append(record)
    await consumer.stop()
    return found


async def test_each_file_is_one_asset_event_and_one_run_through_kills_and_a_replay(
    airflow: AirflowDeployment,
    processes: Processes,
    settings: Settings,
    kafka_clients: KafkaClients,
    inbox: Path,
) -> None:
    af = airflow
    resume = TopicNames(settings.topic_prefix).resume()
    inbox_watch = watcher_prefix(af, "inbox_watcher")
    first = processes.bridge("bridge-1")
    triggerers = [processes.triggerer(name, *FAILOVER_FLAGS) for name in ("t1", "t2")]
    await until(
        lambda: any(t.find("watch started") for t in triggerers), within=120, what="watch started"
    )
    await drop_and_see(af, inbox, 1)
    await drop_and_see(af, inbox, 2)

    # The member running the watch is killed between two files: the other takes it over.
    owner = next(t for t in triggerers if t.find("watch started"))
    owner.proc.send_signal(signal.SIGKILL)
    await drop_and_see(af, inbox, 3)
    survivor = next(t for t in triggerers if t is not owner)
    assert survivor.find("watch started")

    # The bridge is frozen when the next event reaches the resume topic, then killed: the
    # next bridge reclaims the row (Airflow's health threshold) and applies the event.
    first.proc.send_signal(signal.SIGSTOP)
    (inbox / ".flag").write_text("4")
    (inbox / ".flag").rename(inbox / "flag")
    await until(
        lambda: _count(kafka_clients, resume, 4, inbox_watch),
        within=120,
        interval=0.5,
        what="event 4 out",
    )
    assert counts(af) == (3, 3), "the frozen bridge applied nothing"
    first.proc.send_signal(signal.SIGKILL)
    second = processes.bridge("bridge-2")
    await until(
        partial(asyncio.to_thread, lambda: counts(af) == (4, 4)),
        within=120,
        interval=0.3,
        what=lambda: f"event 4 applied by the next bridge (now {counts(af)})",
    )
    await drop_and_see(af, inbox, 5)

    # Everything read again from the start: each event found applied, none applied twice.
    second.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(second.proc.wait, 60) == 0
    await _rewind(kafka_clients, f"{settings.topic_prefix}bridge", resume)
    third = processes.bridge("bridge-3")
    await until(
        lambda: sum(int(str(x["events"])) for x in third.find("watch events applied before")) >= 5,
        within=120,
        interval=0.5,
        what="every event read again and skipped",
    )
    assert counts(af) == (5, 5)

    events = await watch_events(kafka_clients, resume, inbox_watch)
    assert [e.status for e in events] == ["fired"] * 5
    assert len({e.event_id for e in events}) == 5
    mine = {e.trigger_id for e in events}
    applied = [str(e) for (e,) in af.query("SELECT event_id FROM deferline_watch_event")]
    assert sorted(e for e in applied if e.split(":")[0] in mine) == sorted(
        e.event_id for e in events
    )
    extras = af.query(
        "SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
        "WHERE a.name = 'watched_inbox'"
    )
    assert [json.loads(str(x)) for (x,) in extras] == [{"from_trigger": True, "payload": True}] * 5
    assert not af.query("SELECT 1 FROM task_instance WHERE dag_id = 'watched' AND try_number > 1")
    assert sorted(processes.dead()) == sorted(str(p.log_path) for p in (owner, first, second)), (
        "only the processes the test stopped"
    )


def _count(clients: KafkaClients, topic: str, wanted: int, of: str) -> object:
    async def check() -> bool:
        return len(await watch_events(clients, topic, of)) >= wanted

    return check()


async def _rewind(clients: KafkaClients, group: str, topic: str) -> None:
    """Commit offset 0 for ``group`` on every partition of ``topic`` (no member is left)."""
    consumer = await clients.consumer(group_id=group, enable_auto_commit=False)
    await consumer._client.force_metadata_update()
    partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
    consumer.assign(partitions)
    await consumer.commit({tp: 0 for tp in partitions})
    await consumer.stop()


async def test_a_deadline_alert_callback_runs_once_and_one_outside_the_prefixes_never(
    airflow: AirflowDeployment,
    processes: Processes,
    settings: Settings,
    kafka_clients: KafkaClients,
) -> None:
    af = airflow
    run_id = run_id_of(settings, "deadline")
    processes.bridge("bridge")
    processes.triggerer("triggerer")
    await trigger_dag(af, "deadlined", run_id)

    def callbacks() -> list[tuple[str, str | None, str | None]]:
        """The callbacks of this run: path, state, output."""
        found = []
        for data, state, output in af.query("SELECT data, state, output FROM callback"):
            loaded = _plain(json.loads(str(data)))  # as BaseSerialization stored it
            context = (loaded.get("kwargs") or {}).get("context") or {}
            if context.get("dag_run", {}).get("dag_run_id") == run_id:
                state_text = None if state is None else str(state)
                output_text = None if output is None else str(output)
                found.append((str(loaded["path"]), state_text, output_text))
        return sorted(found)

    await until(
        partial(asyncio.to_thread, lambda: [c[1] for c in callbacks()] == ["success", "failed"]),
        within=120,
        interval=0.5,
        what=lambda: f"both callbacks ended (now {callbacks()})",
    )
    [allowed, forbidden] = callbacks()
    assert allowed == ("deadline_callbacks.page", "success", f"paged ops for {run_id}")
    assert forbidden[:2] == ("forbidden_callbacks.page", "failed")
    assert "not under an allowed prefix" in str(forbidden[2])
    # Once: two events (running, then success), the last tombstoned with it.
    resume = TopicNames(settings.topic_prefix).resume()
    events = [
        e
        for e in await watch_events(kafka_clients, resume)
        if isinstance(e.payload, dict) and "state" in e.payload
    ]
    assert [(e.payload["state"], e.last) for e in events] == [("running", False), ("success", True)]
    assert not af.query(
        "SELECT 1 FROM trigger t JOIN callback c ON c.trigger_id = t.id WHERE c.state = 'success'"
    )


def _plain(value: Any) -> Any:
    """A value Airflow's BaseSerialization stored (``{"__var": …, "__type": …}``), plain."""
    if isinstance(value, dict):
        if "__var" in value:
            return _plain(value["__var"])
        return {key: _plain(item) for key, item in value.items()}
    return value


async def test_a_kafka_topic_watcher_makes_each_message_one_asset_event_through_a_restart(
    airflow: AirflowDeployment,
    processes: Processes,
    settings: Settings,
    kafka_clients: KafkaClients,
    orders_topic: str,
) -> None:
    """1,000 orders on a 3-partition topic watched by deferline's ``KafkaWatchTrigger``: the
    triggerer running the watch SIGKILLed halfway and another started; every order is one
    asset event, none applied twice (each event named after its record, its offset
    committed with it)."""
    af = airflow
    admin = await kafka_clients.admin()
    with contextlib.suppress(TopicAlreadyExistsError):  # a run of another test asked first
        await admin.create_topics([NewTopic(orders_topic, num_partitions=3, replication_factor=1)])
    watching = watcher_prefix(af, "orders_watcher")
    producer = await kafka_clients.producer()

    async def orders(numbers: range) -> None:
        records = [(str(n).encode(), orjson.dumps({"kind": "order", "n": n})) for n in numbers]
        await produce(producer, orders_topic, records)

    def asset_events() -> list[dict[str, Any]]:
        rows = af.query(
            "SELECT e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
            "WHERE a.name = 'kafka_orders'"
        )
        return [json.loads(str(extra))["payload"] for (extra,) in rows]

    def count() -> int:
        return len(asset_events())

    processes.bridge("bridge")
    triggerers = {name: processes.triggerer(name, *FAILOVER_FLAGS) for name in ("t1", "t2")}
    await orders(range(500))
    await until(
        partial(asyncio.to_thread, lambda: count() >= 100),
        within=120,
        interval=0.3,
        what=lambda: f"asset events coming (now {count()})",
    )
    resume = TopicNames(settings.topic_prefix).resume()

    async def mine() -> list[WatchEvent]:
        return await watch_events(kafka_clients, resume, watching)

    owner = triggerers[str((await mine())[-1].member)]  # the member running the watch now
    owner.proc.send_signal(signal.SIGKILL)
    processes.triggerer("t3", *FAILOVER_FLAGS)  # the restart
    await orders(range(500, 1000))
    await until(
        partial(asyncio.to_thread, lambda: count() >= 1000),
        within=240,
        interval=0.5,
        what=lambda: f"1,000 asset events (now {count()})",
    )

    # Everything on the resume topic applied or skipped: still 1,000.
    ids = {e.event_id for e in await mine()}

    def recorded() -> set[str]:
        rows = af.query("SELECT event_id FROM deferline_watch_event")
        return {str(e) for (e,) in rows if str(e).startswith(watching)}

    await until(
        partial(asyncio.to_thread, lambda: recorded() >= ids),
        within=60,
        interval=0.5,
        what="every event on the topic applied",
    )
    payloads = asset_events()
    assert len(payloads) == 1000
    assert sorted(p["value"]["n"] for p in payloads) == list(range(1000))
    assert len({(p["partition"], p["offset"]) for p in payloads}) == 1000
    assert len(ids) == 1000, "one event id per record, however often it was read"
    assert sorted(processes.dead()) == [str(owner.log_path)], "only the one the test killed"
