"""Airflow 2.10 triggers' database reads, answered by a server that holds Airflow's database.

Airflow 2.10's triggers read Airflow's database themselves: a connection or variable through
the secrets backends, the last of which is the metastore (``MetastoreBackend``);
``WorkflowTrigger`` (``ExternalTaskSensor``) through ``airflow.utils.sensor_helper._get_count``;
``DagStateTrigger`` (``TriggerDagRunOperator``) through its ``count_dags`` query. In a deferline
triggerer with ``DEFERLINE_AIRFLOW_SERVICES`` set, :class:`Airflow2Services` puts a request to
the services server in the place of each of those reads (the server, ``deferline airflow bridge
--services-port`` on the same Airflow, makes the read with Airflow's own code): the triggers
run unchanged and the triggerer still needs no database credentials. The environment and a
configured secrets backend are still looked in first, in the triggerer, as Airflow does.

The wire is the Airflow 3 one (:class:`~._airflow_services.ServicesClient`), with the same
request and answer shapes where Airflow 3 has the request (``GetConnection``, ``GetVariable``,
``GetDRCount``) and one of 2.10's own, ``GetExternalTaskCount``: ``_get_count``'s arguments,
answered by ``_get_count`` on the server.
"""

from __future__ import annotations

import datetime as dt
import importlib
from typing import Any

import orjson

from ._airflow_services import ServicesClient
from ._errors import AirflowServicesUnavailable

__all__ = ["Airflow2Services"]

_NOT_FOUND = frozenset({"CONNECTION_NOT_FOUND", "VARIABLE_NOT_FOUND"})


class Airflow2Services:
    """Airflow 2.10's database reads, asked of a services server through ``client``."""

    def __init__(self, client: ServicesClient) -> None:
        self.client = client
        self._connection: Any = importlib.import_module("airflow.models.connection").Connection
        self._metastore: Any = importlib.import_module("airflow.secrets.metastore").MetastoreBackend
        self._external_task: Any = importlib.import_module("airflow.triggers.external_task")
        self._replaced: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        """Put the requests in the place of Airflow's reads (undone by :meth:`uninstall`)."""
        services = self

        def get_connection(backend: Any, conn_id: str, session: Any = None) -> Any:
            return services.connection(conn_id)

        def get_variable(backend: Any, key: str, session: Any = None) -> str | None:
            return services.variable(key)

        async def count_dags(trigger: Any, *, session: Any = None) -> int:
            dates = [_iso(d) for d in trigger.execution_dates]
            return await services.dag_run_count(trigger.dag_id, dates, list(trigger.states))

        self._replace(self._metastore, "get_connection", get_connection)
        self._replace(self._metastore, "get_variable", get_variable)
        # WorkflowTrigger._get_count calls the module's _get_count, in sync_to_async's thread.
        self._replace(self._external_task, "_get_count", self.external_task_count)
        self._replace(self._external_task.DagStateTrigger, "count_dags", count_dags)

    def uninstall(self) -> None:
        while self._replaced:
            owner, name, original = self._replaced.pop()
            setattr(owner, name, original)

    def _replace(self, owner: Any, name: str, replacement: Any) -> None:
        self._replaced.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, replacement)

    # The reads --------------------------------------------------------------------------

    def connection(self, conn_id: str) -> Any:
        """The connection as the server's Airflow finds it, or None if it has none."""
        body = self._ask_sync({"type": "GetConnection", "conn_id": conn_id})
        if body is None:
            return None
        return self._connection(
            conn_id=body["conn_id"],
            conn_type=body.get("conn_type"),
            host=body.get("host"),
            schema=body.get("schema"),
            login=body.get("login"),
            password=body.get("password"),
            port=body.get("port"),
            extra=body.get("extra"),
        )

    def variable(self, key: str) -> str | None:
        """The variable's value as the server's Airflow finds it, or None if it has none."""
        body = self._ask_sync({"type": "GetVariable", "key": key})
        return None if body is None else body.get("value")

    def external_task_count(
        self,
        dttm_filter: Any,
        external_task_ids: Any,
        external_task_group_id: str | None,
        external_dag_id: str,
        states: Any,
        session: Any = None,
    ) -> int | float:
        """``airflow.utils.sensor_helper._get_count``, made by the server."""
        dates = dttm_filter if isinstance(dttm_filter, list) else [dttm_filter]
        body = self._ask_sync(
            {
                "type": "GetExternalTaskCount",
                "dag_id": external_dag_id,
                "task_ids": list(external_task_ids) if external_task_ids else None,
                "task_group_id": external_task_group_id,
                "logical_dates": [_iso(d) for d in dates],
                "states": list(states) if states is not None else None,
            }
        )
        return _count(body, "GetExternalTaskCount")

    async def dag_run_count(self, dag_id: str, logical_dates: list[str], states: list[str]) -> int:
        """Runs of ``dag_id`` at those dates in those states (``DagStateTrigger.count_dags``)."""
        request = {
            "type": "GetDRCount",
            "dag_id": dag_id,
            "logical_dates": logical_dates,
            "run_ids": None,
            "states": states,
        }
        answer = _body("GetDRCount", await self.client.ask("GetDRCount", request))
        return int(_count(answer, "GetDRCount"))

    def _ask_sync(self, request: dict[str, Any]) -> dict[str, Any] | None:
        kind = str(request["type"])
        return _body(kind, self.client.ask_sync(kind, request))


def _body(kind: str, frame: bytes) -> dict[str, Any] | None:
    """The answer's body; None for Airflow's not-found; an error answer raised."""
    try:
        answer = orjson.loads(frame)
        body, error = answer.get("body"), answer.get("error")
    except (orjson.JSONDecodeError, AttributeError) as exc:
        raise AirflowServicesUnavailable(f"{kind}: not an Airflow services answer: {exc}") from None
    if error is not None:
        if isinstance(error, dict) and error.get("error") in _NOT_FOUND:
            return None
        raise AirflowServicesUnavailable(f"{kind}: the Airflow services server failed: {error}")
    if body is not None and not isinstance(body, dict):
        raise AirflowServicesUnavailable(f"{kind}: not an Airflow services answer: {body!r}")
    return body


def _count(body: dict[str, Any] | None, kind: str) -> int | float:
    count = None if body is None else body.get("count")
    if not isinstance(count, int | float):
        raise AirflowServicesUnavailable(f"{kind}: the answer has no count: {body!r}")
    return count


def _iso(value: Any) -> str:
    return value.isoformat() if isinstance(value, dt.datetime) else str(value)
