"""``deferline scheduler``: the command line of the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import click
from deferline.engine import Pools
from deferline.schemas import DeferlineError
from deferline.topics import Settings, run_closing

from .._gc import collect_less_often, spare_what_lives_now
from .._options import (
    TRANSACTIONS,
    connection_options,
    layout_options,
    logging_options,
    metrics_options,
    outage_option,
    transactions_option,
)
from .._outage import ride_out

__all__ = ["scheduler_command"]

if TYPE_CHECKING:
    from ._scheduler import Scheduler

logger = logging.getLogger(__name__)


def _parse_pools(values: Iterable[str]) -> dict[str, int]:
    pools: dict[str, int] = {}
    for value in values:
        name, sep, slots = value.partition("=")
        if not sep or not name or not slots.isdigit():
            raise click.BadParameter(f"expected NAME=SLOTS, got {value!r}", param_hint="--pool")
        pools[name] = int(slots)
    return pools


@click.command("scheduler")
@connection_options
@outage_option
@layout_options
@click.option(
    "--pool",
    "pools",
    multiple=True,
    metavar="NAME=SLOTS",
    help="Slots of a pool (repeatable).",
)
@click.option(
    "--default-pool-slots",
    default="128",
    show_default=True,
    help="Slots of every pool not named by --pool (default_pool too); 'unlimited' for none.",
)
@click.option(
    "--worker-queue",
    "worker_queues",
    multiple=True,
    help="Worker queue whose topics are created at start (repeatable).",
)
@click.option("--group-id", default=None, help="Consumer group [<prefix>scheduler].")
@click.option(
    "--group-instance-id",
    default=None,
    help="Static group membership: a scheduler restarted with the same id within the "
    "session timeout keeps its partitions without a rebalance.",
)
@metrics_options
@click.option(
    "--orphan-check-interval",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds between checks for events whose deferral never appears.",
)
@click.option(
    "--session-timeout",
    "--lease-timeout",  # its name when one scheduler held a lease: the same group session
    "session_timeout",
    type=click.FloatRange(min=1.0),
    default=10.0,
    show_default=True,
    help="Seconds without a heartbeat after which the other schedulers take this one's "
    "partitions over (group session; --lease-timeout is its former name).",
)
@transactions_option("Write each batch in a Kafka transaction (fences a paused old owner)")
@click.option(
    "--finished-retention",
    type=click.FloatRange(min=0.0),
    default=3600.0,
    show_default=True,
    help="Seconds a finished task stays in memory (the tasks topic keeps it).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint directory of the task table, one database per tasks partition "
    "[$XDG_STATE_HOME/deferline/scheduler/<group id>]. Schedulers on one host may share it: "
    "a partition whose database another process holds is folded from the topic.",
)
@click.option(
    "--no-checkpoint",
    is_flag=True,
    help="Keep no local checkpoint (every start folds the whole tasks topic).",
)
@click.option(
    "--checkpoint-interval",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Seconds between checkpoints of the task table.",
)
@click.option(
    "--standby",
    is_flag=True,
    help="Keep the other schedulers' tasks partitions folded here too (the memory and CPU "
    "of the whole task table in each scheduler): a partition taken over at a join, a leave "
    "or a failover folds only what was written since. Joins the group once all are folded.",
)
@logging_options
def scheduler_command(
    settings: Settings,
    pools: tuple[str, ...],
    default_pool_slots: str,
    worker_queues: tuple[str, ...],
    group_id: str | None,
    group_instance_id: str | None,
    metrics_port: int | None,
    metrics_host: str,
    orphan_check_interval: float,
    session_timeout: float,
    transactions: str,
    finished_retention: float,
    state_dir: Path | None,
    no_checkpoint: bool,
    checkpoint_interval: float,
    standby: bool,
) -> None:
    """Run the scheduler: fold trigger events into task state and resume tasks."""
    if default_pool_slots == "unlimited":
        default: int | None = None
    elif default_pool_slots.isdigit():
        default = int(default_pool_slots)
    else:
        raise click.BadParameter("a number or 'unlimited'", param_hint="--default-pool-slots")
    from ._checkpoint import default_state_dir
    from ._scheduler import Scheduler

    if no_checkpoint:
        state_dir = None
    elif state_dir is None:
        state_dir = default_state_dir(group_id or f"{settings.topic_prefix}scheduler")

    def build() -> Scheduler:
        return Scheduler(
            settings,
            pools=Pools(slots=_parse_pools(pools), default_slots=default),
            worker_queues=worker_queues,
            group_id=group_id,
            group_instance_id=group_instance_id,
            orphan_check_interval=orphan_check_interval,
            session_timeout=session_timeout,
            transactions=TRANSACTIONS[transactions],
            finished_retention=finished_retention,
            state_dir=state_dir,
            checkpoint_interval=checkpoint_interval,
            standby=standby,
        )

    collect_less_often()
    try:
        run_closing(_serve(build, settings, metrics_port, metrics_host))
    except DeferlineError as exc:
        raise click.ClickException(f"scheduler failed: {exc}") from exc


async def _serve(
    build: Callable[[], Scheduler], settings: Settings, metrics_port: int | None, metrics_host: str
) -> None:
    spare: list[asyncio.Task[None]] = []

    def build_once_spared() -> Scheduler:
        scheduler = build()
        if not spare:  # what the first fold leaves alive lives as long as the process
            spare.append(asyncio.create_task(_spare_fold_when_ready(scheduler)))
        return scheduler

    try:
        await ride_out(
            build_once_spared,
            settings,
            process="scheduler",
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            registry_of=lambda scheduler: scheduler.registry,
        )
    finally:
        for task in spare:
            task.cancel()
    logger.info("scheduler stopped")


async def _spare_fold_when_ready(scheduler: Scheduler) -> None:
    with contextlib.suppress(DeferlineError):  # a failed start is reported by the run
        await scheduler.wait_ready()
        spare_what_lives_now()
