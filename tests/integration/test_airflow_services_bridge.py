"""``deferline airflow bridge --services-port`` answering Airflow 3 triggers' runtime requests.

A real Airflow 3.3 database (SQLite, migrated by ``airflow db migrate``, ``[core]
multi_team`` on, teams ``team_x`` and ``team_y``) with connections and variables stored in it
only, as the UI stores them (encrypted with the deployment's Fernet key), some of them a
team's. Real bridges (processes, on a real broker) serve them; this process asks as a
deferline triggerer does, through Airflow's own lookup code with ``use_airflow_services``,
and holds no database settings. Airflow's scheduler is not needed and does not run.

* A bridge answers with what the database holds, and with Airflow's own errors.
* A team's bridge gives that team's connections and variables and the global ones, never
  another team's; a bridge of no team gives the global ones only.
* With ``DEFERLINE_KWARGS_KEYS`` set, only requests sealed with those keys are answered.
* 1,000 requests in flight: a bridge frozen (SIGSTOP) or gone fails each at the limit with
  the reason and nothing else stops; a bridge (re)started within the limit answers them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from deferline.engine import AirflowServicesUnavailable, preload_airflow, use_airflow_services
from deferline.schemas import KwargsCipher
from deferline.topics import Settings, free_port

from tests._until import until
from tests.airflow_line import STANDARD_TRIGGERS, airflow_version

from ._airflow_deployment import AirflowDeployment
from ._process import DeferlineProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.airflow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        airflow_version() < (3, 3),
        reason="the services answer with Airflow 3.3's request handlers (and its teams)",
    ),
]

PASSWORD = "s3cret-password"
CONNECTIONS = ("api", "team_x_api", "team_y_api", "nowhere")
VARIABLES = ("greeting", "team_x_greeting", "team_y_greeting", "nowhere")
KEY = KwargsCipher.generate_key()


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> AirflowDeployment:
    """Airflow's database with what the UI would have stored: a global connection and
    variable, and one connection and variable of each of two teams."""
    home = tmp_path_factory.mktemp("airflow")
    af = AirflowDeployment(home, extra_env={"AIRFLOW__CORE__MULTI_TEAM": "True"})
    af.run("db", "migrate")
    for team in ("team_x", "team_y"):
        af.run("teams", "create", team)
    connections: dict[str, Any] = {
        "api": {
            "conn_type": "http",
            "host": "api.example",
            "port": 8080,
            "login": "deferline",
            "password": PASSWORD,
            "extra": json.dumps({"timeout": 5, "token": "t0ken"}),
        }
    }
    variables = {"greeting": "hello"}
    for team in ("team_x", "team_y"):
        connections[f"{team}_api"] = {"conn_type": "http", "host": f"{team}.example"}
        variables[f"{team}_greeting"] = f"hello from {team}"
    (home / "connections.json").write_text(json.dumps(connections))
    (home / "variables.json").write_text(json.dumps(variables))
    af.run("connections", "import", str(home / "connections.json"))
    af.run("variables", "import", str(home / "variables.json"))
    for team in ("team_x", "team_y"):
        # The CLI has no team option; the UI and REST API set this column.
        af.query("UPDATE connection SET team_name = ? WHERE conn_id = ?", team, f"{team}_api")
        af.query("UPDATE variable SET team_name = ? WHERE key = ?", team, f"{team}_greeting")
    return af


@pytest.fixture(scope="module")
def airflow_as_library() -> None:
    """Airflow loaded as a deferline triggerer loads it: a library, no database."""
    assert preload_airflow([STANDARD_TRIGGERS])


class Bridge:
    """One ``deferline airflow bridge --services-port`` process over the database."""

    def __init__(
        self,
        settings: Settings,
        af: AirflowDeployment,
        log: Path,
        *args: str,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = DeferlineProcess(
            settings,
            ("airflow", "bridge"),
            log,
            "--bridge-prefix", settings.topic_prefix,
            "--services-port", str(self.port), "--services-host", "127.0.0.1",
            "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1",
            "--log-format", "json",
            *args,
            env={**af.env, **(env or {})},
        )  # fmt: skip

    async def serving(self) -> None:
        await until(
            partial(asyncio.to_thread, lambda: bool(self.process.find("Airflow services serving"))),
            within=180,
            interval=0.5,
            what="the bridge serves",
        )

    def requests_answered(self, kind: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as page:
            text = page.read().decode()
        wanted = f'deferline_airflow_requests_total{{kind="{kind}",outcome="answered"}} '
        lines = [line for line in text.splitlines() if line.startswith(wanted)]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


@pytest.fixture
def bridges(settings: Settings, airflow: AirflowDeployment, tmp_path: Path) -> Iterator[Any]:
    started: list[Bridge] = []

    def start(*args: str, **kwargs: Any) -> Bridge:
        bridge = Bridge(settings, airflow, tmp_path / f"bridge-{len(started)}.log", *args, **kwargs)
        started.append(bridge)
        return bridge

    try:
        yield start
    finally:
        for bridge in started:
            bridge.process.close()


@contextlib.contextmanager
def asking(*urls: str, timeout: float = 60.0, cipher: KwargsCipher | None = None) -> Iterator[None]:
    use_airflow_services(list(urls), timeout=timeout, cipher=cipher)
    try:
        yield
    finally:
        use_airflow_services([])


def comms() -> Any:
    return importlib.import_module("airflow.sdk.execution_time.comms")


async def test_a_bridge_answers_from_airflows_database_with_airflows_errors(
    bridges: Any, airflow_as_library: None
) -> None:
    from airflow.sdk import BaseHook, Variable
    from airflow.sdk.exceptions import AirflowNotFoundException, AirflowRuntimeError

    bridge = bridges()
    with asking(bridge.url):  # asked before the bridge is up: retried until it is
        conn = await BaseHook.aget_connection("api")
        assert (conn.conn_type, conn.host, conn.port) == ("http", "api.example", 8080)
        assert (conn.login, conn.password) == ("deferline", PASSWORD)
        # Sync, inside the loop, as Airflow's own triggers read them: off the loop thread
        # here (the greenback path is tests/engine/test_airflow_services.py's).
        assert await asyncio.to_thread(Variable.get, "greeting") == "hello"
        with pytest.raises(AirflowNotFoundException, match="`nowhere` isn't defined"):
            await BaseHook.aget_connection("nowhere")
        with pytest.raises(AirflowRuntimeError, match="VARIABLE_NOT_FOUND"):
            await asyncio.to_thread(Variable.get, "nowhere")
        # What only the database knows: task instances and DAG runs (none of this DAG).
        supervisor = importlib.import_module("airflow.sdk.execution_time.task_runner")
        ti_count = await supervisor.SUPERVISOR_COMMS.asend(
            comms().GetTICount(dag_id="no_such_dag", task_ids=["t"], states=["success"])
        )
        assert ti_count.count == 0
        dr_count = await supervisor.SUPERVISOR_COMMS.asend(comms().GetDRCount(dag_id="no_dag"))
        assert dr_count.count == 0
        # A bridge of no team: a team's connection is not there for it.
        with pytest.raises(AirflowNotFoundException, match="`team_x_api` isn't defined"):
            await BaseHook.aget_connection("team_x_api")
    assert bridge.requests_answered("GetConnection") >= 3
    # Secrets are never logged by the bridge.
    assert PASSWORD not in bridge.process.log_path.read_text()


async def test_a_teams_bridge_gives_its_teams_connections_and_variables_only(
    bridges: Any, airflow_as_library: None
) -> None:
    from airflow.sdk import BaseHook, Variable
    from airflow.sdk.exceptions import AirflowNotFoundException, AirflowRuntimeError

    bridge = bridges("--team", "team_x")
    with asking(bridge.url):
        assert (await BaseHook.aget_connection("team_x_api")).host == "team_x.example"
        assert (await BaseHook.aget_connection("api")).host == "api.example"  # global
        got = await asyncio.to_thread(Variable.get, "team_x_greeting")
        assert got == "hello from team_x"
        with pytest.raises(AirflowNotFoundException, match="`team_y_api` isn't defined"):
            await BaseHook.aget_connection("team_y_api")
        with pytest.raises(AirflowRuntimeError, match="VARIABLE_NOT_FOUND"):
            await asyncio.to_thread(Variable.get, "team_y_greeting")


async def test_with_kwargs_keys_only_requests_sealed_with_them_are_answered(
    bridges: Any, airflow_as_library: None
) -> None:
    from airflow.sdk import BaseHook

    bridge = bridges(env={"DEFERLINE_KWARGS_KEYS": KEY})
    await bridge.serving()
    with asking(bridge.url, cipher=KwargsCipher([KEY])):
        assert (await BaseHook.aget_connection("api")).password == PASSWORD
    with (
        asking(bridge.url),
        pytest.raises(AirflowServicesUnavailable, match=r"HTTP 401.*only requests sealed"),
    ):
        await BaseHook.aget_connection("api")
    other = KwargsCipher([KwargsCipher.generate_key()])
    with (
        asking(bridge.url, cipher=other),
        pytest.raises(AirflowServicesUnavailable, match=r"HTTP 401.*not opened"),
    ):
        await BaseHook.aget_connection("api")


async def ask_many(n: int) -> list[Any]:
    """``n`` variable reads at once, each its result or its error."""
    supervisor = importlib.import_module("airflow.sdk.execution_time.task_runner")
    ask = supervisor.SUPERVISOR_COMMS.asend
    return await asyncio.gather(
        *(ask(comms().GetVariable(key="greeting")) for _ in range(n)), return_exceptions=True
    )


async def test_requests_to_a_frozen_or_gone_bridge_fail_at_the_limit_and_a_restart_answers(
    bridges: Any, airflow_as_library: None
) -> None:
    bridge = bridges()
    await bridge.serving()
    loop = asyncio.get_running_loop()
    # Frozen (as a network partition looks to a client): each request fails at the limit.
    bridge.process.proc.send_signal(signal.SIGSTOP)
    try:
        with asking(bridge.url, timeout=2.0):
            started = loop.time()
            outcomes = await ask_many(1000)
            took = loop.time() - started
    finally:
        bridge.process.proc.send_signal(signal.SIGCONT)
    assert all(isinstance(o, AirflowServicesUnavailable) for o in outcomes)
    assert "within 2 s" in str(outcomes[0])
    assert took < 30, took
    # Gone: the same, at once refused and retried until the limit.
    port = bridge.port
    bridge.process.close()
    with asking(bridge.url, timeout=1.0):
        outcomes = await ask_many(1000)
    assert all(isinstance(o, AirflowServicesUnavailable) for o in outcomes)
    assert f"within 1 s (DEFERLINE_AIRFLOW_SERVICES_TIMEOUT; servers: {bridge.url})" in str(
        outcomes[0]
    )
    # Started again while 1,000 requests are being retried: every one is answered.
    with asking(bridge.url, timeout=120.0):
        asked = asyncio.ensure_future(ask_many(1000))
        bridges(port=port)
        outcomes = await asked
    assert [getattr(o, "value", o) for o in outcomes] == ["hello"] * 1000


SAME_ANSWERS = """
import json, sys
import airflow.settings
airflow.settings.initialize()
from deferline.runners.airflow_bridge._airflow_requests import AirflowRequests
requests = json.loads(sys.argv[1])
differ = []
for team in (None, "team_x"):
    answers = AirflowRequests(team_name=team)
    for request in requests:
        direct, api = answers.answer(request), answers.answer_through_api(request)
        if direct != api:
            differ.append([team, request, direct, api])
print("differ:", json.dumps(differ))
"""


def test_connections_and_variables_are_answered_as_airflows_api_answers_them(
    airflow: AirflowDeployment,
) -> None:
    """The bridge reads connections and variables without the in-process API's HTTP round:
    the answers (values, masking, not-found errors, a team's scope) are the API's."""
    requests = [
        *({"type": "GetConnection", "conn_id": c} for c in CONNECTIONS),
        *({"type": "GetVariable", "key": k} for k in VARIABLES),
    ]
    done = subprocess.run(
        [sys.executable, "-c", SAME_ANSWERS, json.dumps(requests)],
        env={**airflow.env, "_AIRFLOW_PROCESS_CONTEXT": "server"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    # Airflow logs to stdout too (at exit, its async pool closing): the line the script made.
    [said] = [line for line in done.stdout.splitlines() if line.startswith("differ: ")]
    assert json.loads(said.removeprefix("differ: ")) == []
