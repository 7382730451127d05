"""What the Airflow services tests share: the HTTP endpoint a sensor polls, a deferline
triggerer's environment without Airflow's database, and what the bridge says it answered."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import urllib.request
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests._until import until

from ._airflow_deployment import AirflowDeployment
from ._process import DeferlineProcess

# What the services tests' DAGs name (services_dags.py, services2_dags.py).
HTTP_CONN_ID = "services_http"
VARIABLE_KEY = "services_greeting"
VARIABLE_VALUE = "kept in Airflow's database only"
MISSING_CONN_ID = "services_no_such_conn"  # stored nowhere


def stored_in_database(endpoint: Endpoint) -> list[tuple[str, ...]]:
    """``airflow`` commands storing the HTTP connection to ``endpoint`` and the variable in
    the deployment's database (``before_start``), and nowhere else."""
    connection = ("--conn-type", "http", "--conn-host", "127.0.0.1", "--conn-schema", "http")
    return [
        ("connections", "add", HTTP_CONN_ID, *connection, "--conn-port", str(endpoint.port)),
        ("variables", "set", VARIABLE_KEY, VARIABLE_VALUE),
    ]


class Endpoint(ThreadingHTTPServer):
    """On 127.0.0.1, a free port: ``GET /ready`` answers 404 until ``ready`` is set, then 200;
    ``answers`` records each status given there, in order."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _EndpointHandler)
        self.ready = threading.Event()
        self.answers: list[int] = []

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class _EndpointHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        server = self.server
        assert isinstance(server, Endpoint)
        status = 404
        if self.path.split("?")[0] == "/ready":
            status = 200 if server.ready.is_set() else 404
            server.answers.append(status)
        body = b"ready" if status == 200 else b"not yet"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads ``answers``."""


def triggerer_environment(
    af: AirflowDeployment, home: Path, services: str, allowed: str
) -> dict[str, str]:
    """A deferline triggerer's environment: none of Airflow's settings (its database, its
    connections and variables) but an ``AIRFLOW_HOME`` of its own, the DAGs folder on the
    path (the user trigger module), and the bridge's services."""
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "_AIRFLOW"))}
    assert home != af.home
    env |= {
        "AIRFLOW_HOME": str(home),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(af.dags), os.environ.get("PYTHONPATH", "")) if p
        ),
        "DEFERLINE_ALLOWED_TRIGGER_PREFIXES": allowed,
        "DEFERLINE_AIRFLOW_SERVICES": services,
    }
    # None of Airflow's database settings, connections or variables.
    assert not [k for k in env if k.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_VAR_"))]
    return env


def airflow_database_of(env: dict[str, str]) -> str:
    """``[database] sql_alchemy_conn`` as Airflow, imported with ``env`` as the triggerer
    imports it (as a library), reads it."""
    script = (
        "from airflow.configuration import conf; print(conf.get('database', 'sql_alchemy_conn'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "_AIRFLOW__AS_LIBRARY": "1"},
        capture_output=True,
        timeout=120,
        check=True,
    )
    return done.stdout.decode().strip().splitlines()[-1]


async def dag_run_reaches(af: AirflowDeployment, dag_id: str, run_id: str, wanted: str) -> None:
    def check() -> bool:
        rows = af.query("SELECT state FROM dag_run WHERE dag_id = ? AND run_id = ?", dag_id, run_id)
        return rows == [(wanted,)]

    await until(
        partial(asyncio.to_thread, check),
        within=60,
        interval=0.5,
        what=f"{dag_id} run {run_id} {wanted}",
    )


def requests_answered(metrics_port: int, kind: str) -> float:
    """The bridge's count of ``kind`` requests answered (its metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as page:
        text = page.read().decode()
    wanted = f'deferline_airflow_requests_total{{kind="{kind}",outcome="answered"}} '
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def services_of(process: DeferlineProcess) -> list[object]:
    """The ports the bridge's "Airflow services serving" lines name."""
    return [line.get("services_port") for line in process.find("Airflow services serving")]
