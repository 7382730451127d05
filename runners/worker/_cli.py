"""``deferline worker``: the command line of the worker."""

from __future__ import annotations

import click
from deferline.schemas import DeferlineError
from deferline.topics import InvalidQueueName, Settings, run_closing

from .._options import (
    connection_options,
    group_timing_options,
    logging_options,
    metrics_options,
    outage_option,
)
from .._outage import ride_out
from ._worker import Worker

__all__ = ["worker_command"]


@click.command("worker")
@click.option("--slots", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--queue", default="default", show_default=True, help="Worker queue to consume.")
@click.option(
    "--graceful-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds to let running operators finish on SIGTERM/SIGINT.",
)
@metrics_options
@group_timing_options
@logging_options
@connection_options
@outage_option
def worker_command(
    settings: Settings,
    slots: int,
    queue: str,
    graceful_timeout: float,
    metrics_port: int | None,
    metrics_host: str,
    session_timeout_ms: int,
    heartbeat_interval_ms: int,
) -> None:
    """Run a worker that executes operators and defers them.

    Operators must live under DEFERLINE_ALLOWED_OPERATOR_PREFIXES
    (default: deferline.engine.examples).
    """

    def build() -> Worker:
        return Worker(
            settings,
            slots=slots,
            queue=queue,
            graceful_timeout=graceful_timeout,
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
        )

    try:
        build()
    except InvalidQueueName as exc:
        raise click.BadParameter(str(exc), param_hint="--queue") from exc
    try:
        worker = run_closing(
            ride_out(
                build,
                settings,
                process="worker",
                metrics_port=metrics_port,
                metrics_host=metrics_host,
                registry_of=lambda worker: worker.registry,
            )
        )
    except DeferlineError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"worker stopped: {worker.metrics.as_dict()}")
