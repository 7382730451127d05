"""``deferline broker``: a local broker in the foreground (embedded Tansu, or Apache Kafka)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import click
from deferline.topics import (
    KAFKA_VERSION,
    BrokerStartError,
    KRaftBroker,
    TansuBroker,
    run_closing,
)


@click.command("broker")
@click.option("--port", type=click.IntRange(1, 65535), default=9092, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--advertised-host",
    default=None,
    help="Host clients are told to connect to (default: --host, or 127.0.0.1 for 0.0.0.0). "
    "Tansu only.",
)
@click.option(
    "--kafka",
    is_flag=True,
    help=f"Run Apache Kafka {KAFKA_VERSION} (KRaft, from its jars; needs Java 17+) instead "
    "of the embedded Tansu broker.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="With --kafka: keep the data in this directory and reuse it on the next start "
    "(default: a temporary directory removed at exit).",
)
def broker(
    port: int, host: str, advertised_host: str | None, kafka: bool, data_dir: Path | None
) -> None:
    """Run a local Kafka-protocol broker in the foreground until Ctrl-C (or SIGTERM).

    By default the embedded Tansu broker: data lives in memory and is gone when it stops;
    Tansu has no compaction and no idempotent or transactional producers. With --kafka,
    real Apache Kafka in KRaft mode (one node, broker and controller); its jars are fetched
    from Maven Central into ~/.cache/deferline on first use (needs mvn once).
    """
    server: TansuBroker | KRaftBroker
    if kafka:
        if advertised_host is not None:
            raise click.UsageError("--advertised-host is for Tansu; Kafka advertises --host")
        if host in ("", "0.0.0.0", "::"):
            raise click.UsageError("--kafka needs a --host clients can connect to, not " + host)
        if data_dir is not None and not _ours_or_empty(data_dir):
            raise click.UsageError(
                f"--data-dir {data_dir} is not empty and holds no broker's data: "
                "name a new or empty directory, or one used with --data-dir before"
            )
        server = KRaftBroker(host=host, port=port, data_dir=data_dir)
    elif data_dir is not None:
        raise click.UsageError("--data-dir needs --kafka: Tansu keeps its data in memory")
    else:
        server = TansuBroker(port, host, advertised_host=advertised_host)
    try:
        run_closing(_serve(server))
    except BrokerStartError as exc:
        raise click.ClickException(str(exc)) from exc


def _ours_or_empty(folder: Path) -> bool:
    """Whether ``folder`` may hold the broker's files: new, empty, or a previous data dir."""
    if not folder.exists():
        return True
    return not any(folder.iterdir()) or (folder / "server.properties").exists()


def _describe(server: TansuBroker | KRaftBroker) -> str:
    if isinstance(server, TansuBroker):
        return "Tansu broker (memory storage)"
    where = server.data_dir if server.data_dir is not None else "a temporary directory"
    return f"Apache Kafka {server.version} (KRaft, data in {where})"


async def _serve(server: TansuBroker | KRaftBroker) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.ensure_future(stop.wait())
    if isinstance(server, KRaftBroker):  # seconds to start; its first start fetches the jars
        click.echo(f"starting {_describe(server)}...")
    starting = asyncio.ensure_future(server.start())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # Ctrl-C during startup: start() stops what it began
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        click.echo("stopped before it was ready")
        return
    starting.result()
    try:
        click.echo(f"{_describe(server)} ready. bootstrap: {server.bootstrap}")
        click.echo(f"  export DEFERLINE_BOOTSTRAP_SERVERS={server.bootstrap}")
        click.echo("Press Ctrl-C to stop.")
        exited = asyncio.ensure_future(server.wait())
        await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if exited.done():
            raise BrokerStartError(f"{server.name} exited unexpectedly with code {exited.result()}")
        click.echo("stopping")
    finally:
        stopping.cancel()
        await server.stop()
    await exited  # returns once the stopped process has been reaped
    click.echo("stopped")
