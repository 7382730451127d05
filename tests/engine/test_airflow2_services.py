"""Airflow 2.10 triggers' database reads asked of a services server (``Airflow2Services``).

Airflow 2.10's triggers read Airflow's database themselves. With ``use_airflow_services``,
each read a deferline triggerer cannot make (the metastore's connection and variable lookups,
``WorkflowTrigger``'s and ``DagStateTrigger``'s counts) becomes a request to the server,
here a scripted one on a real socket (tests/engine/_services_server.py). Airflow's own code
runs unchanged around it: the lookups still try the environment first, a not-found is
Airflow's own error, a sync read inside ``run()`` does not block the loop, and with keys the
requests and answers cross sealed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
from typing import Any

import pytest
from deferline.engine import TriggerEvent, load_trigger, preload_airflow, use_airflow_services
from deferline.schemas import KwargsCipher

from tests.airflow_line import STANDARD_TRIGGERS, airflow_line

from ._services_server import Services, asking, collect, serving

pytestmark = [
    pytest.mark.airflow,
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        airflow_line() != 2,
        reason="Airflow 2.10's reads; Airflow 3's requests are tests/engine/test_airflow_services",
    ),
]

USER_TRIGGERS = "tests.integration._airflow_ops"
PREFIXES = [STANDARD_TRIGGERS, USER_TRIGGERS]
WHEN = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)


@pytest.fixture(scope="module")
def airflow_loaded() -> None:
    assert preload_airflow(PREFIXES)
    importlib.import_module(USER_TRIGGERS)


def load(classpath: str, **kwargs: Any) -> Any:
    return load_trigger(classpath, kwargs, allowed_prefixes=PREFIXES)


def dag_state(states: list[str], **kwargs: Any) -> Any:
    """``DagStateTrigger`` waiting for DAG ``target``'s run at ``WHEN``."""
    classpath = f"{STANDARD_TRIGGERS}.external_task.DagStateTrigger"
    return load(classpath, dag_id="target", states=states, execution_dates=[WHEN], **kwargs)


async def test_a_sync_variable_read_inside_run_waits_for_the_server_without_blocking_the_loop(
    airflow_loaded: None,
) -> None:
    """The server answers only once another coroutine opens its gate: a blocked loop could
    never open it, so the trigger firing proves the loop ran while ``Variable.get`` waited."""
    async with serving(Services(variables={"greeting": "hello"})) as services:
        with asking([services.url]):
            trigger = load(f"{USER_TRIGGERS}.GreetingTrigger", key="greeting")
            reading = asyncio.create_task(collect(trigger))
            await asyncio.wait_for(services.arrived.wait(), 10)
            assert not reading.done()
            services.gate.set()
            assert await asyncio.wait_for(reading, 10) == [TriggerEvent({"greeting": "hello"})]
    assert services.asked == [{"type": "GetVariable", "key": "greeting"}]


async def test_airflows_lookups_get_the_servers_answers_after_the_environment(
    airflow_loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.exceptions import AirflowNotFoundException
    from airflow.hooks.base import BaseHook
    from airflow.models import Variable

    monkeypatch.setenv("AIRFLOW_CONN_FROM_ENV", "http://env.example:81")
    services = Services(
        variables={"greeting": "hello"},
        connections={
            "api": {"conn_type": "http", "host": "api.example", "port": 8080, "password": "pw"}
        },
    )
    services.gate.set()
    async with serving(services):
        with asking([services.url]):
            # Sync reads from another thread, as sync_to_async runs them (HttpAsyncHook).
            conn = await asyncio.to_thread(BaseHook.get_connection, "api")
            assert (conn.conn_type, conn.host, conn.port, conn.password) == (
                "http",
                "api.example",
                8080,
                "pw",
            )
            env_conn = await asyncio.to_thread(BaseHook.get_connection, "from_env")
            assert env_conn.host == "env.example"
            with pytest.raises(AirflowNotFoundException, match="`missing` isn't defined"):
                await asyncio.to_thread(BaseHook.get_connection, "missing")
            assert await asyncio.to_thread(Variable.get, "greeting") == "hello"
            with pytest.raises(KeyError, match="missing"):
                await asyncio.to_thread(Variable.get, "missing")
    # The environment answered from_env; the server was asked for the rest only.
    assert services.asked == [
        {"type": "GetConnection", "conn_id": "api"},
        {"type": "GetConnection", "conn_id": "missing"},
        {"type": "GetVariable", "key": "greeting"},
        {"type": "GetVariable", "key": "missing"},
    ]


async def test_with_kwargs_keys_requests_and_answers_cross_sealed(airflow_loaded: None) -> None:
    cipher = KwargsCipher([KwargsCipher.generate_key()])
    services = Services(variables={"password": "s3cret"}, cipher=cipher)
    services.gate.set()
    async with serving(services):
        with asking([services.url], cipher=cipher):
            trigger = load(f"{USER_TRIGGERS}.GreetingTrigger", key="password")
            assert await collect(trigger) == [TriggerEvent({"greeting": "s3cret"})]
    assert services.content_types == ["application/fernet"]


async def test_external_task_sensors_trigger_counts_through_the_server(
    airflow_loaded: None,
) -> None:
    services = Services(counts={"GetExternalTaskCount": 1})
    services.gate.set()
    async with serving(services):
        with asking([services.url]):
            trigger = load(
                f"{STANDARD_TRIGGERS}.external_task.WorkflowTrigger",
                external_dag_id="upstream",
                execution_dates=[WHEN],
                external_task_ids=["task"],
                allowed_states=["success"],
                poke_interval=0.01,
            )
            events = await asyncio.wait_for(collect(trigger), 10)
    assert events == [TriggerEvent({"status": "success"})]
    assert services.asked == [
        {
            "type": "GetExternalTaskCount",
            "dag_id": "upstream",
            "task_ids": ["task"],
            "task_group_id": None,
            "logical_dates": [WHEN.isoformat()],
            "states": ["success"],
        }
    ]


async def test_trigger_dag_run_operators_trigger_counts_runs_through_the_server(
    airflow_loaded: None,
) -> None:
    services = Services(counts={"GetDRCount": 0})
    services.gate.set()
    async with serving(services):
        with asking([services.url]):
            trigger = dag_state(["success", "failed"], poll_interval=0.01)
            waiting = asyncio.create_task(collect(trigger))
            for _ in range(2):  # the run has not ended yet: it asks again
                await asyncio.wait_for(services.arrived.wait(), 10)
                services.arrived.clear()
            assert not waiting.done()
            services.counts["GetDRCount"] = 1
            (event,) = await asyncio.wait_for(waiting, 10)
    assert event.payload[1]["dag_id"] == "target"
    assert services.asked[0] == {
        "type": "GetDRCount",
        "dag_id": "target",
        "logical_dates": [WHEN.isoformat()],
        "run_ids": None,
        "states": ["success", "failed"],
    }


async def test_without_services_a_read_of_the_database_fails_naming_it(
    airflow_loaded: None,
) -> None:
    from deferline.engine import AirflowDatabaseUnavailable

    use_airflow_services([])
    trigger = dag_state(["success"])
    with pytest.raises(AirflowDatabaseUnavailable, match="DagStateTrigger"):
        await asyncio.wait_for(collect(trigger), 10)


async def test_an_unanswered_count_fails_its_trigger_clearly_within_the_limit(
    airflow_loaded: None,
) -> None:
    from deferline.engine import AirflowServicesUnavailable

    services = Services()  # its gate stays closed: nothing is answered
    async with serving(services):
        with asking([services.url], timeout=0.5):
            trigger = dag_state(["success"])
            with pytest.raises(AirflowServicesUnavailable, match=r"GetDRCount: no Airflow serv"):
                await asyncio.wait_for(collect(trigger), 10)
