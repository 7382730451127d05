"""``deferline topics``: create deferline's topics, or show what the cluster has."""

from __future__ import annotations

import click
from deferline.topics import (
    ROLES,
    BrokerError,
    InvalidQueueName,
    Settings,
    TopicDescription,
    describe_topics,
    ensure_acls,
    ensure_topics,
    parse_role_principals,
    run_closing,
    topic_specs,
    trigger_logs_spec,
)

from ._options import connection_options, layout_options

# The configs deferline sets; `topics list` shows these rather than every broker default.
_SHOWN_CONFIGS = (
    "cleanup.policy",
    "retention.ms",
    "min.compaction.lag.ms",
    "delete.retention.ms",
    "segment.ms",
)


@click.group("topics")
def topics() -> None:
    """Create or inspect deferline's topics."""


@topics.command("ensure")
@click.option(
    "--queue",
    "queues",
    multiple=True,
    help="Trigger queue: also create defer.<queue> and resume.<queue>. Repeatable.",
)
@click.option(
    "--worker-queue",
    "worker_queues",
    multiple=True,
    help="Worker queue: also create queue.<name> and queue.<name>.resumes. Repeatable.",
)
@click.option(
    "--acls",
    "acls",
    multiple=True,
    metavar="ROLE=PRINCIPAL",
    help=f"Also create the least-privilege ACLs of ROLE ({', '.join(ROLES)}) for PRINCIPAL "
    "(e.g. worker=User:deferline-worker), for these queues. Repeatable. Needs a principal "
    "that may alter ACLs.",
)
@click.option(
    "--trigger-logs",
    is_flag=True,
    help="Also create trigger.logs, where triggerers run with --trigger-logs ship the log "
    "lines of their triggers for the Airflow bridge (they create it themselves when they may).",
)
@layout_options
@connection_options
def ensure(
    settings: Settings,
    queues: tuple[str, ...],
    worker_queues: tuple[str, ...],
    acls: tuple[str, ...],
    trigger_logs: bool,
) -> None:
    """Create the missing topics (idempotent) and check defer/resume co-partitioning."""
    try:
        specs = topic_specs(settings, queues, worker_queues)
        if trigger_logs:
            specs.append(trigger_logs_spec(settings))
        principals = parse_role_principals(acls)
    except (InvalidQueueName, ValueError) as exc:
        raise click.BadParameter(str(exc)) from exc
    try:
        run_closing(ensure_topics(settings, specs, strict=True))
        found = run_closing(describe_topics(settings, [s.name for s in specs]))
        bindings = (
            run_closing(
                ensure_acls(settings, principals, queues=queues, worker_queues=worker_queues)
            )
            if principals
            else []
        )
    except BrokerError as exc:
        raise click.ClickException(str(exc)) from exc
    _print(found)
    for binding in bindings:
        click.echo(
            f"ACL {binding.principal} {binding.operation} "
            f"{binding.resource_type} {binding.resource_name}"
        )


@topics.command("list")
@click.option(
    "--all", "show_all", is_flag=True, help="Every topic, not only those under the prefix."
)
@connection_options
def list_topics(settings: Settings, show_all: bool) -> None:
    """List topics with partitions, replication factor and retention/compaction configs."""
    try:
        found = run_closing(describe_topics(settings, prefix="" if show_all else None))
    except BrokerError as exc:
        raise click.ClickException(str(exc)) from exc
    if not found:
        click.echo(f"no topics under prefix {settings.topic_prefix!r}")
        return
    _print(found)


def _print(found: list[TopicDescription]) -> None:
    width = max(len("TOPIC"), *(len(t.name) for t in found))
    click.echo(f"{'TOPIC':<{width}}  PARTITIONS  RF  CONFIG")
    for t in found:
        config = " ".join(f"{k}={t.config[k]}" for k in _SHOWN_CONFIGS if k in t.config) or "-"
        click.echo(f"{t.name:<{width}}  {t.partitions:>10}  {t.replication_factor:>2}  {config}")
