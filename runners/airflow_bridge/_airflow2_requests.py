"""Airflow 2.10 triggers' database reads, made as the triggers make them in Airflow's triggerer.

A deferline triggerer on Airflow 2.10 asks for what its triggers would read from Airflow's
database (``engine/_airflow2_services.py``): a connection or variable, the count
``ExternalTaskSensor``'s ``WorkflowTrigger`` makes, the count ``TriggerDagRunOperator``'s
``DagStateTrigger`` makes. :class:`Airflow2Requests` makes each read with Airflow's own code on
the bridge's database (``Connection.get_connection_from_secrets``,
``Variable.get_variable_from_secrets``, ``sensor_helper._get_count``, ``count_dags``' query), and
answers in the Airflow 3 response frame the services wire carries. Synchronous; the services
server calls it from worker threads.
"""

from __future__ import annotations

import datetime as dt
import importlib
import logging
from collections.abc import Callable
from typing import Any

from ._airflow_requests import RequestRefused

__all__ = ["Airflow2Requests"]

logger = logging.getLogger(__name__)


class Airflow2Requests:
    """Answers Airflow 2.10 triggers' reads for one bridge.

    Args:
        team_name: must be None: teams are Airflow 3.3's.
    """

    def __init__(self, *, team_name: str | None = None) -> None:
        if team_name is not None:
            raise ValueError("--team is for Airflow 3.3's multi_team; this is Airflow 2")
        self.team_name = None
        self._connection: Any = importlib.import_module("airflow.models.connection").Connection
        self._variable: Any = importlib.import_module("airflow.models.variable").Variable
        self._dag_run: Any = importlib.import_module("airflow.models.dagrun").DagRun
        self._not_found: Any = importlib.import_module(
            "airflow.exceptions"
        ).AirflowNotFoundException
        self._sensor_count: Any = importlib.import_module("airflow.utils.sensor_helper")._get_count
        self._session: Any = importlib.import_module("airflow.utils.session").create_session
        self._func: Any = importlib.import_module("sqlalchemy").func
        self._handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "GetConnection": self._get_connection,
            "GetVariable": self._get_variable,
            "GetDRCount": self._get_dr_count,
            "GetExternalTaskCount": self._get_external_task_count,
        }

    @property
    def kinds(self) -> frozenset[str]:
        """The request kinds answered."""
        return frozenset(self._handlers)

    def answer(self, request: Any) -> dict[str, Any]:
        """Answer one request (its JSON form) with the response frame ``{"body": …,
        "error": …}``. Raises :class:`RequestRefused` for what no trigger may ask."""
        kind = request.get("type") if isinstance(request, dict) else None
        handler = self._handlers.get(kind) if isinstance(kind, str) else None
        if handler is None:
            raise RequestRefused(
                f"not a request Airflow 2.10's triggers make through the bridge: {kind!r}"
            )
        try:
            frame = handler(request)
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestRefused(f"malformed {kind}: {type(exc).__name__}: {exc}") from None
        if frame["error"] is not None and frame["error"]["error"] == "API_SERVER_ERROR":
            # As the Airflow 3 side logs it; the request itself is not logged.
            logger.warning("Airflow services: %s failed: %s", kind, frame["error"]["detail"])
        return frame

    def warm_up(self) -> None:
        """Open the database once, so that the first trigger to ask does not wait for it."""
        self.answer({"type": "GetDRCount", "dag_id": "__deferline_warm_up__"})

    def _get_connection(self, request: dict[str, Any]) -> dict[str, Any]:
        conn_id = _text(request, "conn_id")
        try:
            conn = self._connection.get_connection_from_secrets(conn_id)
        except self._not_found:
            return _error("CONNECTION_NOT_FOUND", {"conn_id": conn_id})
        except Exception as exc:
            return _failed(exc)
        fields = ("conn_id", "conn_type", "host", "schema", "login", "password", "port", "extra")
        body = {"type": "ConnectionResult"} | {name: getattr(conn, name) for name in fields}
        return {"body": body, "error": None}

    def _get_variable(self, request: dict[str, Any]) -> dict[str, Any]:
        key = _text(request, "key")
        try:
            value = self._variable.get_variable_from_secrets(key)
        except Exception as exc:
            return _failed(exc)
        if value is None:
            return _error("VARIABLE_NOT_FOUND", {"key": key})
        return {"body": {"type": "VariableResult", "key": key, "value": value}, "error": None}

    def _get_dr_count(self, request: dict[str, Any]) -> dict[str, Any]:
        """``DagStateTrigger.count_dags``' query; each filter given is applied."""
        run = self._dag_run
        filters = [run.dag_id == _text(request, "dag_id")]
        if (dates := _dates(request.get("logical_dates"))) is not None:
            filters.append(run.execution_date.in_(dates))
        if (run_ids := request.get("run_ids")) is not None:
            filters.append(run.run_id.in_(list(run_ids)))
        if (states := request.get("states")) is not None:
            filters.append(run.state.in_(list(states)))
        try:
            with self._session() as session:
                count = session.query(self._func.count("*")).filter(*filters).scalar()
        except Exception as exc:
            return _failed(exc)
        return {"body": {"type": "DRCount", "count": int(count)}, "error": None}

    def _get_external_task_count(self, request: dict[str, Any]) -> dict[str, Any]:
        """``airflow.utils.sensor_helper._get_count``, as ``WorkflowTrigger`` calls it."""
        states = request.get("states")
        try:
            count = self._sensor_count(
                dttm_filter=_dates(request.get("logical_dates")) or [],
                external_task_ids=request.get("task_ids"),
                external_task_group_id=request.get("task_group_id"),
                external_dag_id=_text(request, "dag_id"),
                states=list(states) if states is not None else None,
            )
        except Exception as exc:
            return _failed(exc)
        return {"body": {"type": "ExternalTaskCount", "count": count}, "error": None}


def _text(request: dict[str, Any], name: str) -> str:
    value = request[name]
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")
    return value


def _dates(values: Any) -> list[dt.datetime] | None:
    if values is None:
        return None
    return [dt.datetime.fromisoformat(v) for v in values]


def _error(error: str, detail: dict[str, Any]) -> dict[str, Any]:
    return {"body": None, "error": {"type": "ErrorResponse", "error": error, "detail": detail}}


def _failed(exc: Exception) -> dict[str, Any]:
    # As the Airflow 3 bridge frames an error its handler raised.
    detail = {"status_code": None, "message": str(exc), "exception_type": type(exc).__name__}
    return _error("API_SERVER_ERROR", detail)
