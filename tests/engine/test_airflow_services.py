"""Airflow 3 triggers' runtime requests sent to a services server (``RemoteSupervisor``).

The server here is an aiohttp app on a real socket that speaks the services wire
(docs/protocol.md, "Airflow services") with answers the test scripts: it stands in for
``deferline airflow bridge --services-port``, which tests/integration/test_airflow_services*
run against Airflow's database. What is tested here is the triggerer's side: Airflow's own
code (``Variable.get``, ``BaseHook.get_connection``, the secrets lookup) gets the answers and
errors, a sync call inside ``run()`` never blocks the loop, an unanswered request becomes a
clear error within the limit, servers are tried in turn, and sealed requests.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from deferline.engine import (
    AirflowServicesUnavailable,
    TriggerEvent,
    load_trigger,
    preload_airflow,
)
from deferline.schemas import KwargsCipher

from tests.airflow_line import STANDARD_TRIGGERS, airflow_line

from ._services_server import Services, asking, collect, listening, serving

pytestmark = [
    pytest.mark.airflow,
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        airflow_line() < 3,
        reason="Airflow 3's requests; Airflow 2.10's reads are tests/engine/test_airflow2_services",
    ),
]

USER_TRIGGERS = "tests.integration._airflow_ops"
PREFIXES = [STANDARD_TRIGGERS, USER_TRIGGERS]


@pytest.fixture(scope="module")
def airflow_loaded() -> None:
    assert preload_airflow(PREFIXES)
    importlib.import_module(USER_TRIGGERS)


def comms() -> Any:
    return importlib.import_module("airflow.sdk.execution_time.task_runner").SUPERVISOR_COMMS


def greeting(**kwargs: Any) -> Any:
    return load_trigger(f"{USER_TRIGGERS}.GreetingTrigger", kwargs, allowed_prefixes=PREFIXES)


async def test_a_sync_variable_read_inside_run_waits_for_the_server_without_blocking_the_loop(
    airflow_loaded: None,
) -> None:
    """The server answers only once another coroutine opens its gate: a blocked loop could
    never open it, so the trigger firing proves the loop ran while ``Variable.get`` waited."""
    async with serving(Services(variables={"greeting": "hello"})) as services:
        with asking([services.url]):
            reading = asyncio.create_task(collect(greeting(key="greeting")))
            await asyncio.wait_for(services.arrived.wait(), 10)
            assert not reading.done()
            services.gate.set()
            assert await asyncio.wait_for(reading, 10) == [TriggerEvent({"greeting": "hello"})]
    assert services.asked == [{"type": "GetVariable", "key": "greeting"}]


async def test_airflows_own_lookups_get_the_servers_answers_and_not_found_errors(
    airflow_loaded: None,
) -> None:
    from airflow.sdk import BaseHook, Variable
    from airflow.sdk.exceptions import AirflowNotFoundException, AirflowRuntimeError

    services = Services(
        variables={"greeting": "hello"},
        connections={"api": {"conn_type": "http", "host": "api.example", "port": 8080}},
    )
    services.gate.set()
    async with serving(services):
        with asking([services.url]):
            conn = await BaseHook.aget_connection("api")
            assert (conn.conn_type, conn.host, conn.port) == ("http", "api.example", 8080)
            with pytest.raises(AirflowNotFoundException, match="`missing` isn't defined"):
                await BaseHook.aget_connection("missing")
            with pytest.raises(AirflowRuntimeError, match="VARIABLE_NOT_FOUND"):
                await asyncio.to_thread(Variable.get, "missing")  # sync, from another thread
            count = await comms().asend(
                importlib.import_module("airflow.sdk.execution_time.comms").GetTICount(
                    dag_id="d", task_ids=["t"]
                )
            )
            assert count.count == 2


async def test_an_unanswered_request_fails_its_trigger_clearly_within_the_limit(
    airflow_loaded: None,
) -> None:
    """A server that never answers: the asking trigger gets AirflowServicesUnavailable (never
    Airflow's "not defined", which would name the wrong cause) and the loop goes on."""
    from airflow.sdk import BaseHook

    async with serving(Services()) as services:  # gate never opened
        with asking([services.url], timeout=0.5):
            loop = asyncio.get_running_loop()
            started = loop.time()
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            with pytest.raises(AirflowServicesUnavailable) as caught:
                await BaseHook.aget_connection("api")
            ticker.cancel()
            assert loop.time() - started < 5
            assert ticks > 0
            message = str(caught.value)
            for said in ("GetConnection", services.url, "within 0.5 s", "_SERVICES_TIMEOUT"):
                assert said in message
            with pytest.raises(AirflowServicesUnavailable):
                await collect(greeting(key="greeting"))


async def test_servers_are_tried_in_turn_and_a_restart_within_the_limit_is_ridden_out(
    airflow_loaded: None,
) -> None:
    from airflow.sdk import Variable

    services = Services(variables={"greeting": "hello"})
    services.gate.set()
    async with serving(services):
        down = "http://127.0.0.1:9"  # discard port: connection refused
        with asking([down, services.url], timeout=10):
            assert await asyncio.to_thread(Variable.get, "greeting") == "hello"
    # The only server is down when the request is made, and comes up while it is retried.
    async with listening(_refusing(503, "probe")) as probe:
        port = int(probe.rsplit(":", 1)[1])
    late = Services(variables={"greeting": "late"})
    late.gate.set()
    with asking([f"http://127.0.0.1:{port}"], timeout=20):
        reading = asyncio.create_task(collect(greeting(key="greeting")))
        await asyncio.sleep(0.3)  # the outage lasts a while on purpose
        assert not reading.done()
        async with serving(late, port):
            assert await asyncio.wait_for(reading, 15) == [TriggerEvent({"greeting": "late"})]


async def test_with_kwargs_keys_requests_and_answers_cross_sealed(airflow_loaded: None) -> None:
    cipher = KwargsCipher([KwargsCipher.generate_key()])
    services = Services(variables={"password": "s3cret"}, cipher=cipher)
    services.gate.set()
    async with serving(services):
        with asking([services.url], cipher=cipher):
            assert await collect(greeting(key="password")) == [TriggerEvent({"greeting": "s3cret"})]
    assert services.content_types == ["application/fernet"]


def _refusing(status: int, text: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        return web.Response(status=status, text=text)

    return handle


async def test_a_refusal_is_not_retried_and_says_why(airflow_loaded: None) -> None:
    refusing = _refusing(401, "this bridge answers only sealed requests")
    async with listening(refusing) as url:
        with asking([url], timeout=30):
            started = asyncio.get_running_loop().time()
            with pytest.raises(AirflowServicesUnavailable, match=r"HTTP 401.*only sealed"):
                await collect(greeting(key="greeting"))
            assert asyncio.get_running_loop().time() - started < 5


async def test_an_answer_this_airflow_cannot_read_is_an_error_not_a_missing_connection(
    airflow_loaded: None,
) -> None:
    """A bridge on another Airflow version answering in a shape this one does not know: the
    trigger is told so, where Airflow's lookup would report the connection as not defined."""
    from airflow.sdk import BaseHook

    async def old_shape(request: web.Request) -> web.Response:
        body = {"body": {"conn_id": "api", "type": "ConnectionResult"}, "error": None}
        return web.json_response(body)

    async with listening(old_shape) as url:
        with (
            asking([url]),
            pytest.raises(AirflowServicesUnavailable, match="same Airflow version"),
        ):
            await BaseHook.aget_connection("api")


async def test_with_airflows_portal_switch_off_a_sync_call_in_the_loop_says_what_to_use(
    airflow_loaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AIRFLOW_DISABLE_GREENBACK_PORTAL=true``, Airflow's own switch: no portal, so a sync
    call inside ``run()`` cannot wait without blocking the loop; it fails at once, saying so."""
    monkeypatch.setenv("AIRFLOW_DISABLE_GREENBACK_PORTAL", "true")
    services = Services(variables={"greeting": "hello"})
    services.gate.set()
    async with serving(services):
        with (
            asking([services.url]),
            pytest.raises(AirflowServicesUnavailable, match="aget_connection"),
        ):
            await collect(greeting(key="greeting"))
    assert services.asked == []


async def test_requests_behind_a_backlog_wait_while_the_server_keeps_answering(
    airflow_loaded: None,
) -> None:
    """A bridge working through a burst (here one answer each 0.1 s) is not a silent one:
    the requests queued behind it wait their turn past the limit, and none fails."""
    from airflow.sdk import Variable

    turn = asyncio.Lock()

    async def one_at_a_time(request: web.Request) -> web.Response:
        asked = orjson.loads(await request.read())["request"]
        async with turn:
            await asyncio.sleep(0.1)
        body = {"key": asked["key"], "value": asked["key"].upper(), "type": "VariableResult"}
        return web.json_response({"body": body, "error": None})

    async with listening(one_at_a_time) as url:
        with asking([url], timeout=0.5):
            keys = [f"key{i}" for i in range(20)]  # distinct: no two share a request
            started = asyncio.get_running_loop().time()
            values = await asyncio.gather(*(asyncio.to_thread(Variable.get, k) for k in keys))
            assert asyncio.get_running_loop().time() - started > 1.5  # well past the limit
    assert values == [k.upper() for k in keys]
