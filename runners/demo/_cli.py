"""``deferline demo``: the command line of the demo (its options, parsed into DemoOptions)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
from pathlib import Path

import click
from deferline.schemas import DeferlineError
from deferline.topics import run_closing
from rich.console import Console

from ._plan import DemoOptions
from ._run import run_demo
from ._summary import DemoSummary, print_summary

__all__ = ["demo_command"]


@click.command("demo")
@click.option("--tasks", type=click.IntRange(min=10), default=2000, show_default=True)
@click.option(
    "--duration",
    type=click.FloatRange(min=4.0),
    default=40.0,
    show_default=True,
    help="Triggers fire within this many seconds of submission.",
)
@click.option("--seed", type=int, default=7, show_default=True)
@click.option(
    "--deadline",
    type=click.FloatRange(min=10.0),
    default=None,
    help="Give up (and fail) after this many seconds [105; 240 with --broker kafka, a JVM "
    "sharing the machine].",
)
@click.option("--no-kill", is_flag=True, help="Do not SIGKILL a triggerer halfway.")
@click.option(
    "--kill-scheduler",
    is_flag=True,
    help="Run two schedulers (each owns half the task partitions); SIGKILL one halfway.",
)
@click.option("--plain", is_flag=True, help="Print progress lines instead of the live view.")
@click.option("--topic-prefix", default=None, help="Topic prefix [demo-<random>.].")
@click.option(
    "--broker",
    type=click.Choice(["tansu", "kafka"]),
    default="tansu",
    show_default=True,
    help="Embedded Tansu, or Apache Kafka (KRaft) from its jars (needs Java 17+).",
)
@click.option(
    "--summary-json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the summary to this file as JSON.",
)
def demo_command(
    tasks: int,
    duration: float,
    seed: int,
    deadline: float | None,
    no_kill: bool,
    kill_scheduler: bool,
    plain: bool,
    topic_prefix: str | None,
    broker: str,
    summary_json: Path | None,
) -> None:
    """Run the end-to-end demo on the embedded broker (Apache Kafka with --broker kafka)."""
    console = Console()
    options = DemoOptions(
        tasks=tasks,
        duration=duration,
        seed=seed,
        deadline=deadline if deadline is not None else (240.0 if broker == "kafka" else 105.0),
        kill=not no_kill,
        kill_scheduler=kill_scheduler,
        live=not plain and console.is_terminal,
        topic_prefix=topic_prefix,
        broker=broker,
    )
    try:
        summary = run_closing(_main(options, console))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process was stopped[/]")
        raise SystemExit(130) from None
    except DeferlineError as exc:
        raise click.ClickException(str(exc)) from exc
    print_summary(summary, console)
    if summary_json is not None:
        summary_json.write_text(json.dumps(dataclasses.asdict(summary), indent=2))
    if not summary.ok:
        raise SystemExit(1)


async def _main(options: DemoOptions, console: Console) -> DemoSummary:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    return await run_demo(options, console)
