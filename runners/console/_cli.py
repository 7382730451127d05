"""`deferline console`: the command that serves the page."""

from __future__ import annotations

import datetime as dt
import os
import secrets

import click
from deferline.replay import GroupHints
from deferline.replay._cli import DURATION
from deferline.schemas import DeferlineError
from deferline.topics import Settings, run_closing

from .._options import connection_options, logging_options, outage_option
from .._outage import ride_out
from ._console import Console, ConsoleOptions

__all__ = ["console_command"]

TOKEN_ENV = "DEFERLINE_CONSOLE_TOKEN"


@click.command("console")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8780, show_default=True)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Interface to bind (0.0.0.0 to serve other machines; put authentication in front).",
)
@click.option(
    "--stuck-older-than",
    type=DURATION,
    default="10m",
    show_default=True,
    help="A task waiting on a trigger this long is on the stuck list.",
)
@click.option(
    "--stuck-every",
    type=DURATION,
    default="10s",
    show_default=True,
    help="How often the stuck list is read again (each time a replay read of the topics).",
)
@click.option(
    "--allow-redrive",
    is_flag=True,
    help=f"Offer a re-drive button, guarded by a token (${TOKEN_ENV}, or one printed at start).",
)
@click.option("--triggerer-group", multiple=True, help="Default <prefix>triggerer[.<queue>].")
@click.option("--scheduler-group", multiple=True, help="Default <prefix>scheduler.")
@logging_options
@connection_options
@outage_option
def console_command(
    settings: Settings,
    port: int,
    host: str,
    stuck_older_than: dt.timedelta,
    stuck_every: dt.timedelta,
    allow_redrive: bool,
    triggerer_group: tuple[str, ...],
    scheduler_group: tuple[str, ...],
) -> None:
    """Serve a live web page of the loop, the groups, stuck deferrals and dead letters.

    It reads only the topics and the consumer groups (a consumer without a group: nothing is
    committed). Read-only unless --allow-redrive.
    """
    token = None
    if allow_redrive:
        token = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
        if TOKEN_ENV not in os.environ:
            click.echo(f"re-drive token: {token}", err=True)
    defaults = GroupHints.for_prefix(settings.topic_prefix)
    options = ConsoleOptions(
        host=host,
        port=port,
        stuck_older_than=stuck_older_than,
        stuck_every_s=stuck_every.total_seconds(),
        redrive_token=token,
        hints=GroupHints(
            triggerer=triggerer_group or defaults.triggerer,
            scheduler=scheduler_group or defaults.scheduler,
            worker=defaults.worker,
        ),
    )
    try:
        Console(settings, options)
    except DeferlineError as exc:  # e.g. a kwargs key that is not a Fernet key
        raise click.UsageError(str(exc)) from exc
    click.echo(f"deferline console on http://{host}:{port}/", err=True)
    try:
        run_closing(ride_out(lambda: Console(settings, options), settings, process="console"))
    except DeferlineError as exc:  # e.g. the port is taken
        raise click.ClickException(str(exc)) from exc
