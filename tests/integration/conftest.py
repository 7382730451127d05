"""Fixtures of the Airflow deployment tests (each module gives its own ``airflow``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from deferline.topics import Settings

from ._airflow_deployment import AirflowDeployment
from ._airflow_processes import Processes
from ._services_kit import Endpoint


@pytest.fixture
def processes(
    settings: Settings, airflow: AirflowDeployment, tmp_path: Path
) -> Iterator[Processes]:
    """The bridges and triggerers one test starts on its prefix, killed at its end."""
    started = Processes(settings, airflow, tmp_path)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Endpoint]:
    """An HTTP endpoint a sensor polls (``Endpoint``), for the module."""
    server = Endpoint()
    thread = threading.Thread(target=server.serve_forever, name="endpoint", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
