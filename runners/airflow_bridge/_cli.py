"""``deferline airflow bridge``: the command that stands in for ``airflow triggerer``."""

from __future__ import annotations

import dataclasses
import logging
import os

import click
from deferline.engine import AirflowEnvironmentError
from deferline.schemas import DeferlineError
from deferline.topics import Settings, run_closing
from pydantic import ValidationError

from .._gc import collect_less_often, spare_what_lives_now
from .._options import (
    connection_options,
    layout_options,
    logging_options,
    metrics_options,
    outage_option,
)
from .._outage import ride_out
from ._airflow_db import AirflowDatabase
from ._bridge import AirflowBridge, BridgeOptions

__all__ = ["airflow_command"]


@click.group("airflow")
def airflow_command() -> None:
    """Serve an Airflow deployment's deferred tasks from deferline."""


@airflow_command.command("bridge")
@connection_options
@outage_option
@layout_options
@click.option(
    "--bridge-prefix",
    envvar="DEFERLINE_AIRFLOW_PREFIX",
    default=None,
    help="Topic prefix of the bridge and of the triggerers serving it "
    "[<topic prefix>airflow., i.e. deferline.airflow.] [env: DEFERLINE_AIRFLOW_PREFIX]",
)
@click.option(
    "--queues",
    default=None,
    help="Comma-separated Airflow trigger queues to serve (Airflow 3.2+, with [triggerer] "
    "queues_enabled), as `airflow triggerer --queues`; none: rows without a queue.",
)
@click.option(
    "--team", "team_name", default=None, help="Airflow team to serve (3.3+, [core] multi_team)."
)
@click.option(
    "--capacity",
    type=click.IntRange(min=1),
    default=100_000,
    show_default=True,
    help="Trigger rows claimed at most (they run in deferline's triggerers).",
)
@click.option(
    "--claim-per-loop",
    type=click.IntRange(min=1),
    default=5_000,
    show_default=True,
    help="Rows claimed per loop at most (Airflow's max_trigger_to_select_per_loop).",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between claim loops.",
)
@click.option(
    "--max-events",
    type=click.IntRange(min=1),
    default=5_000,
    show_default=True,
    help="Events written back per database transaction at most.",
)
@click.option(
    "--writers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Batches written back at once, each in its own transaction (a database with cores "
    "to spare; 1 on SQLite).",
)
@click.option(
    "--services-port",
    envvar="DEFERLINE_AIRFLOW_SERVICES_PORT",
    type=click.IntRange(min=0, max=65535),
    default=None,
    help="Answer Airflow triggers' runtime requests (connections and variables from "
    "Airflow's database, task and DAG-run state; on Airflow 3 XCom and human-in-the-loop too) "
    "on this port, for "
    "triggerers given DEFERLINE_AIRFLOW_SERVICES=http://<this host>:<port> (0: any free port) "
    "[env: DEFERLINE_AIRFLOW_SERVICES_PORT]",
)
@click.option(
    "--services-host",
    envvar="DEFERLINE_AIRFLOW_SERVICES_HOST",
    default="0.0.0.0",
    show_default=True,
    help="Interface the services listen on [env: DEFERLINE_AIRFLOW_SERVICES_HOST]",
)
@click.option(
    "--trigger-logs/--no-trigger-logs",
    envvar="DEFERLINE_TRIGGER_LOGS",
    default=False,
    show_default=True,
    help="Write the trigger log lines the triggerers ship (deferline triggerer "
    "--trigger-logs) where Airflow's UI reads them, and serve them on [logging] "
    "trigger_log_server_port, as airflow triggerer does [env: DEFERLINE_TRIGGER_LOGS]",
)
@metrics_options
@logging_options
def bridge_command(
    settings: Settings,
    bridge_prefix: str | None,
    queues: str | None,
    team_name: str | None,
    capacity: int,
    claim_per_loop: int,
    poll_interval: float,
    max_events: int,
    writers: int,
    services_port: int | None,
    services_host: str,
    trigger_logs: bool,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run a bridge: Airflow's triggerer to Airflow, deferline's triggerers doing the work.

    Reads Airflow's configuration as every Airflow process does (AIRFLOW_HOME, airflow.cfg,
    AIRFLOW__DATABASE__SQL_ALCHEMY_CONN, AIRFLOW__CORE__FERNET_KEY) and deferline's
    (DEFERLINE_*). Start deferline triggerers with `--topic-prefix` set to the bridge prefix.
    """
    prefix = bridge_prefix or f"{settings.topic_prefix}airflow."
    try:
        bridge_settings = Settings(**{**settings.model_dump(), "topic_prefix": prefix})
    except ValidationError as exc:
        raise click.BadParameter(str(exc), param_hint="--bridge-prefix") from exc
    options = BridgeOptions(
        capacity=capacity,
        claim_per_loop=claim_per_loop,
        queues=tuple(q.strip() for q in (queues or "").split(",") if q.strip()),
        team_name=team_name,
        poll_interval=poll_interval,
        max_events=max_events,
        writers=writers,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        services_port=services_port,
        services_host=services_host,
        trigger_logs=trigger_logs,
    )
    # Airflow is loaded whole here, with its database: this process is one of Airflow's. Its
    # logging set-up comes with it; deferline's, made before, is put back afterwards.
    os.environ.pop("_AIRFLOW__AS_LIBRARY", None)
    # One of Airflow's server processes (as its scheduler, API server, triggerer's
    # supervisor): Airflow's SDK looks up variables and connections it needs here (a
    # start_from_trigger template's `var`) in the metastore.
    os.environ.setdefault("_AIRFLOW_PROCESS_CONTEXT", "server")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        database = AirflowDatabase(queues=options.queues, team_name=team_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "airflow":
            raise
        raise click.UsageError(
            "Airflow is not installed here: run the bridge where your Airflow processes run "
            "(pip install 'deferline[airflow]', or 'deferline[airflow2]' for 2.10)"
        ) from exc
    except AirflowEnvironmentError as exc:
        raise click.ClickException(f"unsupported Airflow environment: {exc}") from exc
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    root.handlers[:] = handlers
    root.setLevel(level)
    # Airflow loaded is hundreds of thousands of objects no collection would free: out of the
    # collector's reach, and the young generation collected less often (runners/_gc.py).
    collect_less_often()
    spare_what_lives_now()
    # Restarted in place after a lost cluster, a bridge ends its TriggererJob row and starts
    # a new one: its rows are claimed again (docs/airflow.md, "When the Kafka cluster is lost").
    served = dataclasses.replace(options, metrics_port=None)  # served across restarts instead
    try:
        run_closing(
            ride_out(
                lambda: AirflowBridge(bridge_settings, served, database=database),
                bridge_settings,
                process="airflow bridge",
                metrics_port=metrics_port,
                metrics_host=metrics_host,
                registry_of=lambda bridge: bridge.metrics.registry if bridge.metrics else None,
            )
        )
    except DeferlineError as exc:
        raise click.ClickException(f"airflow bridge failed: {exc}") from exc
