"""Reusable click options: connection flags that build a Settings (flags override env), and
the metrics, group-timing and logging flags every process shares."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import click
from deferline.topics import Settings, access_error, principal_of, run_closing
from deferline.topics._clients import is_bootstrap_failure, probe_access
from pydantic import ValidationError

F = TypeVar("F", bound=Callable[..., Any])

_SETTINGS_FIELDS = frozenset(Settings.model_fields)


def _env(name: str) -> str:
    return f"[env: DEFERLINE_{name.upper()}]"


_CONNECTION: list[Callable[[F], F]] = [
    click.option(
        "--bootstrap-servers",
        help="Comma-separated host:port list (default localhost:9092). "
        + _env("bootstrap_servers"),
    ),
    click.option("--client-id", help=f"Client id sent to the brokers. {_env('client_id')}"),
    click.option(
        "--security-protocol",
        type=click.Choice(["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]),
        help=f"{_env('security_protocol')}",
    ),
    click.option(
        "--sasl-mechanism",
        type=click.Choice(["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]),
        help=f"{_env('sasl_mechanism')}",
    ),
    click.option("--sasl-username", help=f"{_env('sasl_username')}"),
    click.option(
        "--sasl-password",
        help=f"Prefer the environment: flags show in process lists. {_env('sasl_password')}",
    ),
    click.option(
        "--ssl-cafile",
        type=click.Path(exists=True, dir_okay=False),
        help=f"CA bundle for the brokers' certificates. {_env('ssl_cafile')}",
    ),
    click.option(
        "--ssl-certfile",
        type=click.Path(exists=True, dir_okay=False),
        help=f"Client certificate (mutual TLS). {_env('ssl_certfile')}",
    ),
    click.option(
        "--ssl-keyfile",
        type=click.Path(exists=True, dir_okay=False),
        help=f"Client key (mutual TLS). {_env('ssl_keyfile')}",
    ),
    click.option(
        "--topic-prefix",
        help=f"Prefix of every topic (default 'deferline.'). {_env('topic_prefix')}",
    ),
]

_LAYOUT: list[Callable[[F], F]] = [
    click.option(
        "--partitions",
        type=click.IntRange(min=1),
        help=f"Partitions of new topics (default 12). {_env('partitions')}",
    ),
    click.option(
        "--replication-factor",
        type=click.IntRange(min=1),
        help=f"Replication factor of new topics (default 1). {_env('replication_factor')}",
    ),
]


def settings_from_flags(**flags: Any) -> Settings:
    """A Settings from flags that were given (not None), the environment for the rest."""
    try:
        return Settings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise click.UsageError(f"invalid settings: {problems}") from exc


@contextlib.contextmanager
def access_errors_named(settings: Settings) -> Iterator[None]:
    """Turn an authentication or authorization failure, wherever it surfaces in a command or
    a process start-up, into one clear CLI error (exit 1) that names the broker's error, the
    resource and the principal, instead of a traceback or a misleading message."""
    try:
        yield
    except (click.exceptions.Exit, click.exceptions.Abort, KeyboardInterrupt):
        raise
    except Exception as exc:
        mapped = access_error(exc, principal=principal_of(settings))
        if mapped is None and is_bootstrap_failure(exc):
            # aiokafka says only "Unable to bootstrap": ask the broker once more for why.
            mapped = run_closing(probe_access(settings))
        if mapped is None:
            raise
        raise click.ClickException(f"{type(mapped).__name__}: {mapped}") from exc


def connection_options(func: F) -> F:
    """Add the connection flags; the command receives ``settings: Settings`` instead.

    Any other option named after a Settings field (see :func:`layout_options`) is folded
    into the same Settings.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        flags = {name: kwargs.pop(name) for name in list(kwargs) if name in _SETTINGS_FIELDS}
        settings = kwargs["settings"] = settings_from_flags(**flags)
        with access_errors_named(settings):
            return func(*args, **kwargs)

    command = cast(F, wrapper)
    for option in reversed(_CONNECTION):
        command = option(command)
    return command


def layout_options(func: F) -> F:
    """Add ``--partitions`` and ``--replication-factor`` (use under connection_options)."""
    for option in reversed(_LAYOUT):
        func = option(func)
    return func


def outage_option(func: F) -> F:
    """Add ``--outage-limit`` (use under connection_options, as it is a Settings field)."""
    return click.option(
        "--outage-limit",
        type=click.FloatRange(min=0.1),
        help="Seconds to ride out a Kafka cluster that does not answer before exiting "
        f"non-zero (default 300). {_env('outage_limit')}",
    )(func)


def logging_options(func: F) -> F:
    """Add ``--log-level`` and ``--log-format`` and configure logging before the command runs."""
    from ._logging import configure_logging

    @functools.wraps(func)
    def wrapper(*args: Any, log_level: str, log_format: str, **kwargs: Any) -> Any:
        configure_logging(log_level, "json" if log_format == "json" else "text")
        return func(*args, **kwargs)

    command = click.option(
        "--log-format", default="text", show_default=True, type=click.Choice(["text", "json"])
    )(cast(F, wrapper))
    return click.option(
        "--log-level",
        default="INFO",
        show_default=True,
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    )(command)


def metrics_options(func: F) -> F:
    """Add ``--metrics-port`` and ``--metrics-host`` (a Prometheus endpoint, off by default)."""
    func = click.option("--metrics-host", default="0.0.0.0", show_default=True)(func)
    return click.option(
        "--metrics-port",
        type=click.IntRange(min=0, max=65535),
        default=None,
        help="Serve Prometheus metrics on this port (0: any free port).",
    )(func)


def group_timing_options(func: F) -> F:
    """Add ``--session-timeout-ms`` and ``--heartbeat-interval-ms`` (consumer-group liveness)."""
    func = click.option(
        "--heartbeat-interval-ms", type=click.IntRange(min=100), default=250, show_default=True
    )(func)
    return click.option(
        "--session-timeout-ms", type=click.IntRange(min=1000), default=10_000, show_default=True
    )(func)


TRANSACTIONS: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
"""``--transactions`` as the processes take it: None means "when the broker has them"."""


def transactions_option(what: str) -> Callable[[F], F]:
    """Add ``--transactions auto|on|off``; ``what`` says what goes in each transaction."""
    return click.option(
        "--transactions",
        type=click.Choice(list(TRANSACTIONS)),
        default="auto",
        show_default=True,
        help=f"{what}; auto: when the broker has transactions.",
    )
