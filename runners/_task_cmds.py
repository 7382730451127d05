"""`deferline submit`, `deferline tasks` and `deferline clear`: the client API from a shell."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, get_args

import click
import orjson
from deferline.client import Client, TaskNotFound
from deferline.schemas import DeferlineError, TaskState, TaskStateRecord, encode, utcnow
from deferline.topics import Settings, run_closing
from rich.console import Console
from rich.table import Table

from ._options import connection_options

__all__ = ["clear", "submit", "tasks"]

T = TypeVar("T")

_STATES: tuple[str, ...] = get_args(TaskState)
_STYLE = {
    "success": "green",
    "failed": "red",
    "up_for_retry": "yellow",
    "deferred": "magenta",
    "running": "cyan",
    "queued": "blue",
    "skipped": "dim",
    "removed": "dim",
}


def _run(settings: Settings, work: Callable[[Client], Awaitable[T]]) -> T:
    """Run ``work`` with a started client; deferline errors become clean CLI errors."""

    async def main() -> T:
        async with Client(settings) as client:
            return await work(client)

    try:
        return run_closing(main())
    except TaskNotFound as exc:
        raise click.ClickException(str(exc)) from exc
    except DeferlineError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


def _json_object(value: str | None, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=what) from exc
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object", param_hint=what)
    return parsed


@click.command("submit")
@click.argument("operator")
@click.option("--dag-id", required=True)
@click.option("--task-id", required=True)
@click.option("--run-id", default=None, help="Default: manual__<UTC timestamp>.")
@click.option("--map-index", type=click.IntRange(min=-1), default=-1, show_default=True)
@click.option("--kwargs", "op_kwargs", default=None, help="Operator kwargs as a JSON object.")
@click.option("--queue", default="default", show_default=True, help="Worker queue.")
@click.option("--pool", default="default_pool", show_default=True)
@click.option("--pool-slots", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--priority-weight", type=int, default=1, show_default=True)
@click.option("--retries", type=click.IntRange(min=0), default=0, show_default=True)
@click.option(
    "--start-from-trigger/--no-start-from-trigger",
    default=None,
    help="Defer at start without a worker (default: when the operator class says so).",
)
@connection_options
def submit(
    settings: Settings,
    operator: str,
    dag_id: str,
    task_id: str,
    run_id: str | None,
    map_index: int,
    op_kwargs: str | None,
    queue: str,
    pool: str,
    pool_slots: int,
    priority_weight: int,
    retries: int,
    start_from_trigger: bool | None,
) -> None:
    """Submit OPERATOR (an import path, e.g. deferline.engine.examples.WaitOperator)."""
    kwargs = _json_object(op_kwargs, "--kwargs")
    run = run_id or f"manual__{utcnow().strftime('%Y-%m-%dT%H:%M:%S.%fZ')}"
    task = _run(
        settings,
        lambda client: client.submit(
            operator,
            dag_id=dag_id,
            task_id=task_id,
            run_id=run,
            map_index=map_index,
            op_kwargs=kwargs,
            queue=queue,
            pool=pool,
            pool_slots=pool_slots,
            priority_weight=priority_weight,
            retries=retries,
            start_from_trigger=start_from_trigger,
        ),
    )
    click.echo(task.ti_key)


@click.command("tasks")
@click.option(
    "--state",
    "states",
    type=click.Choice(_STATES),
    multiple=True,
    help="Only tasks in this state (repeatable).",
)
@click.option("--dag-id", default=None, help="Only tasks of this DAG.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@connection_options
def tasks(settings: Settings, states: tuple[str, ...], dag_id: str | None, as_json: bool) -> None:
    """List task instances and their latest state (read from the tasks topic)."""
    records = _run(settings, lambda client: client.list_tasks(state=states or None))  # type: ignore[arg-type]
    if dag_id is not None:
        records = [r for r in records if r.task.dag_id == dag_id]
    if as_json:
        for record in records:
            click.echo(orjson.dumps(_as_json(record)).decode())
        return
    _table(records)


def _as_json(record: TaskStateRecord) -> dict[str, Any]:
    """The record's wire JSON (see docs/protocol.md) plus its ``ti_key``."""
    data: dict[str, Any] = orjson.loads(encode(record))
    data["ti_key"] = record.task.ti_key
    return data


def _table(records: list[TaskStateRecord]) -> None:
    table = Table(title=f"{len(records)} task(s)")
    table.add_column("task", overflow="fold")
    for column in ("try", "state", "trigger", "seq", "updated (UTC)"):
        table.add_column(column, no_wrap=True)
    table.add_column("reason", overflow="fold")
    for record in records:
        style = _STYLE.get(record.state, "")
        table.add_row(
            record.task.ti_key,
            str(record.task.try_number),
            f"[{style}]{record.state}[/]" if style else record.state,
            (record.trigger_id or "")[:8],
            str(record.defer_seq) if record.trigger_id else "",
            record.updated_at.strftime("%m-%d %H:%M:%S"),
            record.reason or "",
        )
    Console().print(table)


@click.command("clear")
@click.argument("task")
@click.option("--reason", default="cleared", show_default=True)
@connection_options
def clear(settings: Settings, task: str, reason: str) -> None:
    """Clear TASK (dag_id/task_id/run_id[/map_index]): mark it removed.

    If it is deferred, the scheduler cancels its trigger.
    """
    record = _run(settings, lambda client: client.clear(task, reason=reason))
    was = f" (trigger {record.trigger_id} will be cancelled)" if record.trigger_id else ""
    click.echo(f"{record.task.ti_key}: removed{was}")
