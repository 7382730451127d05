"""An aiohttp app served from the process's own event loop (metrics, Airflow services)."""

from __future__ import annotations

from aiohttp import web

__all__ = ["serve"]


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0: any free port); the runner to clean up and the bound
    port. Raises ``OSError`` when the address cannot be bound, after releasing the runner."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    sockets = getattr(site._server, "sockets", None) or []
    bound: int = sockets[0].getsockname()[1] if sockets else port
    return runner, bound
