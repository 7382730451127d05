"""``deferline broker``: the embedded Tansu broker in the foreground."""

from __future__ import annotations

import asyncio
import signal

import click
from deferline.topics import BrokerStartError, TansuBroker


@click.command("broker")
@click.option("--port", type=click.IntRange(1, 65535), default=9092, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--advertised-host",
    default=None,
    help="Host clients are told to connect to (default: --host, or 127.0.0.1 for 0.0.0.0).",
)
def broker(port: int, host: str, advertised_host: str | None) -> None:
    """Run the embedded Kafka-compatible broker (Tansu, in memory) until Ctrl-C.

    Data lives in memory and is gone when the broker stops. Tansu has no compaction and
    no idempotent or transactional producers; use Apache Kafka for production.
    """
    try:
        asyncio.run(_serve(TansuBroker(port, host, advertised_host=advertised_host)))
    except BrokerStartError as exc:
        raise click.ClickException(str(exc)) from exc


async def _serve(tansu: TansuBroker) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with tansu:
        click.echo(f"Tansu broker (memory storage) ready. bootstrap: {tansu.bootstrap}")
        click.echo(f"  export DEFERLINE_BOOTSTRAP_SERVERS={tansu.bootstrap}")
        click.echo("Press Ctrl-C to stop.")
        exited = asyncio.ensure_future(tansu.wait())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if exited.done():
            raise BrokerStartError(f"Tansu exited unexpectedly with code {exited.result()}")
        click.echo("stopping")
    await exited  # returns once the stopped process has been reaped
