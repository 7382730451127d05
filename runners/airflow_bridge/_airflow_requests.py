"""Airflow 3 triggers' runtime requests, answered as Airflow's triggerer answers them.

Airflow's triggerer supervisor (``TriggerRunnerSupervisor._handle_request``) answers each
request of its triggers with the handlers of ``airflow.sdk.execution_time.request_handlers``
over an in-process Execution API client (``InProcessExecutionAPI``: Airflow's API app called
in-process, straight on the database, no token). :class:`AirflowRequests` does the same for
triggers running in deferline's triggerers: the same handlers, the same client, the same
answers and errors. Synchronous (Airflow's client is); the services server calls it from
worker threads.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

__all__ = ["AirflowRequests", "RequestRefused"]

logger = logging.getLogger(__name__)


class RequestRefused(Exception):
    """Not a request a trigger may make (malformed, or one only Airflow's own triggerer
    runner sends); the client is told why."""


Handler = Callable[[Any, Any], tuple[Any, dict[str, bool]]]


class AirflowRequests:
    """Answers runtime requests (``ToTriggerSupervisor`` messages but the runner's own state
    sync) for one bridge, scoped to its Airflow team.

    Args:
        team_name: the team the bridge serves (``--team``): with ``[core] multi_team``, a
            connection or variable is looked up for that team (its own, then the global
            ones), as the Execution API looks them up for that team's tasks.
    """

    def __init__(self, *, team_name: str | None) -> None:
        if importlib.util.find_spec("airflow.sdk") is None:
            airflow: Any = importlib.import_module("airflow")
            raise ValueError(
                f"AirflowRequests answers Airflow 3's trigger requests, and this is Airflow "
                f"{airflow.__version__}: Airflow2Requests answers 2.10's"
            )
        self.team_name = team_name
        # Airflow's in-process API warns about itself, in plain text amid a bridge's JSON log
        # lines: Starlette's test client on import, its own variable reads on every request.
        warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
        warnings.filterwarnings("ignore", message="Using Variable.get from `airflow.models`")
        comms: Any = importlib.import_module("airflow.sdk.execution_time.comms")
        handlers: Any = importlib.import_module("airflow.sdk.execution_time.request_handlers")
        runner: Any = importlib.import_module("airflow.jobs.triggerer_job_runner")
        self._decoder: Any = runner.TriggerRunnerSupervisor.decoder
        self._hitl_result: Any = runner.HITLDetailResponseResult
        self._ok: Any = comms.OKResponse
        self._error: Any = comms.ErrorResponse
        self._error_type: Any = importlib.import_module("airflow.sdk.exceptions").ErrorType
        self._server_error: type[Exception] = importlib.import_module(
            "airflow.sdk.api.client"
        ).ServerResponseError
        h = handlers
        self._lookups = _Lookups(handlers, comms.ErrorResponse, self._error_type, team_name)
        # What TriggerRunnerSupervisor._handle_request does per request kind.
        self._handlers: dict[str, Handler] = {
            "GetConnection": self._lookups.get_connection,
            "GetVariable": self._lookups.get_variable,
            "GetVariableKeys": h.handle_get_variable_keys,
            "PutVariable": h.handle_put_variable,
            "DeleteVariable": h.handle_delete_variable,
            "GetXCom": h.handle_get_xcom,
            "SetXCom": h.handle_set_xcom,
            "DeleteXCom": h.handle_delete_xcom,
            "GetTICount": h.handle_get_ti_count,
            "GetTaskStates": h.handle_get_task_states,
            "GetPreviousTI": h.handle_get_previous_ti,
            "GetDRCount": h.handle_get_dr_count,
            "GetDagRunState": h.handle_get_dag_run_state,
            "GetAssetStateStoreByName": h.handle_get_asset_state_store_by_name,
            "GetAssetStateStoreByUri": h.handle_get_asset_state_store_by_uri,
            "SetAssetStateStoreByName": self._ok_after(h.handle_set_asset_state_store_by_name),
            "SetAssetStateStoreByUri": self._ok_after(h.handle_set_asset_state_store_by_uri),
            "DeleteAssetStateStoreByName": self._ok_after(
                h.handle_delete_asset_state_store_by_name
            ),
            "DeleteAssetStateStoreByUri": self._ok_after(h.handle_delete_asset_state_store_by_uri),
            "ClearAssetStateStoreByName": self._ok_after(h.handle_clear_asset_state_store_by_name),
            "ClearAssetStateStoreByUri": self._ok_after(h.handle_clear_asset_state_store_by_uri),
            "GetHITLDetailResponse": self._hitl_get,
            "UpdateHITLDetail": self._hitl_update,
        }
        self._through_api = self._handlers | {
            "GetConnection": h.handle_get_connection,
            "GetVariable": h.handle_get_variable,
        }
        self._client: Any = None

    @property
    def kinds(self) -> frozenset[str]:
        """The request kinds answered."""
        return frozenset(self._handlers)

    def answer(self, request: Any) -> dict[str, Any]:
        """Answer one request (its JSON form) with Airflow's response frame: ``{"body": …,
        "error": …}``. Raises :class:`RequestRefused` for what no trigger may ask."""
        return self._answer(self._handlers, request)

    def _answer(self, handlers: dict[str, Handler], request: Any) -> dict[str, Any]:
        kind = request.get("type") if isinstance(request, dict) else None
        handler = handlers.get(kind) if isinstance(kind, str) else None
        if handler is None:
            raise RequestRefused(f"not a request Airflow's triggerer answers a trigger: {kind!r}")
        try:
            msg = self._decoder.validate_python(request)
        except ValueError as exc:  # pydantic's ValidationError
            raise RequestRefused(f"malformed {kind}: {exc}") from None
        try:
            response, dump = handler(self.client, msg)
        except self._server_error as exc:
            # As Airflow's supervisor answers an API error (WatchedSubprocess.handle_requests).
            reply: Any = getattr(exc, "response", None)
            detail = reply.json() if reply is not None else None
            status = reply.status_code if reply is not None else None
            error = {"status_code": status, "message": str(exc), "detail": detail}
            return self._error_frame(error)
        except Exception as exc:
            # Airflow's supervisor logs these too; the request itself is not logged.
            logger.warning("Airflow services: %s failed: %s: %s", kind, type(exc).__name__, exc)
            error = {"status_code": None, "message": str(exc), "exception_type": type(exc).__name__}
            return self._error_frame(error)
        body = response.model_dump(mode="json", **dump) if response is not None else None
        return {"body": body, "error": None}

    def _error_frame(self, detail: dict[str, Any]) -> dict[str, Any]:
        error = self._error(error=self._error_type.API_SERVER_ERROR, detail=detail)
        return {"body": None, "error": error.model_dump(mode="json")}

    def warm_up(self) -> None:
        """Build Airflow's in-process API and answer one request, so that the first trigger
        to ask does not wait seconds for it."""
        self.answer({"type": "GetDRCount", "dag_id": "__deferline_warm_up__"})

    @property
    def client(self) -> Any:
        """Airflow's Execution API client on the in-process API, as its triggerer makes it
        (``TriggerRunnerSupervisor.make_client``), with the bridge's team for lookups."""
        if self._client is None:
            client_module: Any = importlib.import_module("airflow.sdk.api.client")
            runner: Any = importlib.import_module("airflow.jobs.triggerer_job_runner")
            api = runner.in_process_api_server()
            if self.team_name is not None:
                security: Any = importlib.import_module(
                    "airflow.api_fastapi.execution_api.security"
                )
                team = self.team_name

                async def bridge_team() -> str | None:
                    return team

                api.app.dependency_overrides[security.get_team_name_dep] = bridge_team
            client = client_module.Client(
                base_url=None, token="", dry_run=True, transport=api.transport
            )
            client.base_url = "http://in-process.invalid./"
            self._client = client
        return self._client

    def answer_through_api(self, request: Any) -> dict[str, Any]:
        """:meth:`answer` with every kind through the in-process API, as Airflow's triggerer
        answers it (what the direct lookups are tested against)."""
        return self._answer(self._through_api, request)

    def _ok_after(self, handler: Handler) -> Handler:
        def ok(client: Any, msg: Any) -> tuple[Any, dict[str, bool]]:
            handler(client, msg)
            return self._ok(ok=True), {}

        return ok

    def _hitl_get(self, client: Any, msg: Any) -> tuple[Any, dict[str, bool]]:
        response = client.hitl.get_detail_response(ti_id=msg.ti_id)
        return self._hitl_result.from_api_response(response=response), {}

    def _hitl_update(self, client: Any, msg: Any) -> tuple[Any, dict[str, bool]]:
        response = client.hitl.update_response(
            ti_id=msg.ti_id, chosen_options=msg.chosen_options, params_input=msg.params_input
        )
        return self._hitl_result.from_api_response(response=response), {}


class _Lookups:
    """``GetConnection`` and ``GetVariable`` without the in-process API's HTTP round: the
    lookup its route makes (``Connection.get_connection_from_secrets`` /
    ``Variable.get`` with the team, a not-found as its client returns it), the answer through
    the route's model and the client's, then Airflow's own handler (masking, shaping). The
    same answer (tested against :meth:`AirflowRequests.answer_through_api`) for about a
    tenth of the CPU: these two are most of what triggers ask."""

    def __init__(self, handlers: Any, error: Any, error_type: Any, team_name: str | None) -> None:
        self._handlers = handlers
        self._error = error
        self._error_type = error_type
        self._team = team_name
        self._connection: Any = importlib.import_module("airflow.models.connection").Connection
        self._variable: Any = importlib.import_module("airflow.models.variable").Variable
        self._not_found: Any = importlib.import_module(
            "airflow.exceptions"
        ).AirflowNotFoundException
        api: Any = importlib.import_module("airflow.api_fastapi.execution_api.datamodels")
        self._api_connection: Any = importlib.import_module(f"{api.__name__}.connection")
        self._api_variable: Any = importlib.import_module(f"{api.__name__}.variable")
        self._sdk: Any = importlib.import_module("airflow.sdk.api.datamodels._generated")

    def get_connection(self, client: Any, msg: Any) -> tuple[Any, dict[str, bool]]:
        try:
            conn = self._connection.get_connection_from_secrets(msg.conn_id, team_name=self._team)
        except self._not_found:
            found: Any = self._error(
                error=self._error_type.CONNECTION_NOT_FOUND, detail={"conn_id": msg.conn_id}
            )
        else:
            route = self._api_connection.ConnectionResponse.model_validate(conn)
            found = self._sdk.ConnectionResponse.model_validate(
                route.model_dump(mode="json", by_alias=True)
            )
        answered: Any = SimpleNamespace(connections=SimpleNamespace(get=lambda _: found))
        result: tuple[Any, dict[str, bool]] = self._handlers.handle_get_connection(answered, msg)
        return result

    def get_variable(self, client: Any, msg: Any) -> tuple[Any, dict[str, bool]]:
        try:
            value = self._variable.get(msg.key, team_name=self._team)
        except KeyError:
            found: Any = self._error(
                error=self._error_type.VARIABLE_NOT_FOUND, detail={"key": msg.key}
            )
        else:
            route = self._api_variable.VariableResponse(key=msg.key, value=value)
            found = self._sdk.VariableResponse.model_validate(
                route.model_dump(mode="json", by_alias=True)
            )
        answered: Any = SimpleNamespace(variables=SimpleNamespace(get=lambda _: found))
        result: tuple[Any, dict[str, bool]] = self._handlers.handle_get_variable(answered, msg)
        return result
