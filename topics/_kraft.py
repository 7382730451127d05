"""Single-node Apache Kafka in KRaft mode, plain or secured (SASL_SSL/SCRAM, mutual TLS)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._errors import BrokerStartError
from ._kafka_runtime import (
    KAFKA_VERSION,
    _format_storage,
    _jvm,
    _new_cluster_id,
    default_cache_dir,
    fetch_kafka_jars,
)
from ._process import _BrokerProcess, free_port
from ._tls import ThrowawayTLS

logger = logging.getLogger(__name__)


class KRaftBroker(_BrokerProcess):
    """Single-node Apache Kafka in KRaft mode (combined broker and controller) from its jars.

    The jars are resolved once through Maven (``org.apache.kafka:kafka_2.13:<version>``) into
    ``<cache_dir>/kafka-<version>/lib`` (default cache dir ``~/.cache/deferline``); later
    starts need neither Maven nor the network. Needs Java 17+.

    ``data_dir``: keep the configuration, log and data there, and start from that data again
    next time (formatted on first use only); default a temporary folder removed on stop.
    ``request_log``: a file the broker writes a line to per request it completed, with its
    timings (``kafka.request.logger`` at DEBUG; for benchmarks that look inside a request).
    """

    name = "kafka"

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        version: str = KAFKA_VERSION,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 90.0,
        heap: str = "768m",
        security: BrokerSecurity | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        request_log: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(host=host, port=port, startup_timeout=startup_timeout, data_dir=data_dir)
        self.request_log = Path(request_log) if request_log is not None else None
        """Where the broker logs each request it completed (with its timings); None: not."""
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.version = version
        self.heap = heap
        self.security = security
        self._internal_port: int | None = None
        self._jvm: list[str] = []
        self.tls: ThrowawayTLS | None = None
        """The throw-away CA and broker certificate, once started with ``security``."""

    def client_settings(self, username: str | None = None, **overrides: Any) -> dict[str, Any]:
        """Settings keyword arguments for a client of this broker (as ``username``).

        Without ``security`` only ``bootstrap_servers``; with it, SASL_SSL/SCRAM-SHA-512 as
        ``username`` (default: the admin) trusting the throw-away CA.
        """
        return _client_settings(self.bootstrap, self.security, self.tls, username, overrides)

    def _internal(self) -> int:
        self._internal_port = free_port(self.host)
        return self._internal_port

    async def set_password(self, user: str, password: str) -> None:
        """Change (or create) ``user``'s SCRAM-SHA-512 credential on the running broker.

        Runs Kafka's own ConfigCommand over the mutual-TLS internal listener as the brokers'
        super-user principal; connections already authenticated stay so until they
        re-authenticate (``BrokerSecurity.reauth_ms``) or reconnect.
        """
        if self.security is None or self.tls is None or self._workdir is None:
            raise BrokerStartError("set_password needs a running broker started with security")
        config = self._workdir / "internal-client.properties"
        config.write_text(
            "security.protocol=SSL\n"
            "ssl.keystore.type=PEM\n"
            f"ssl.keystore.location={self.tls.keystore_file}\n"
            "ssl.truststore.type=PEM\n"
            f"ssl.truststore.location={self.tls.ca_file}\n"
        )
        command = await asyncio.create_subprocess_exec(
            *self._jvm,
            "kafka.admin.ConfigCommand",
            "--bootstrap-server",
            f"{self.host}:{self._internal_port}",
            "--command-config",
            str(config),
            "--alter",
            "--entity-type",
            "users",
            "--entity-name",
            user,
            "--add-config",
            f"SCRAM-SHA-512=[password={password}]",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        out, _ = await command.communicate()
        if command.returncode != 0:
            raise BrokerStartError(
                f"ConfigCommand failed (exit {command.returncode}): "
                + out.decode(errors="replace")[-2000:]
            )

    async def _wait_ready(self) -> None:
        if self.security is None:
            await super()._wait_ready()
            return
        assert self._proc is not None
        await _wait_admin_ready(
            self._proc,
            self.client_settings(),
            self.startup_timeout,
            brokers=1,
            log_tail=self._log_tail,
            name=self.name,
        )

    async def _prepare(self, workdir: Path) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise BrokerStartError(
                "java is not on PATH: KRaftBroker runs Apache Kafka from its jars and needs "
                "Java 17+ (Debian: apt-get install -y openjdk-17-jre-headless)"
            )
        lib = await asyncio.to_thread(fetch_kafka_jars, self.cache_dir, version=self.version)
        assert self._port is not None
        controller_port = free_port(self.host)
        properties = workdir / "server.properties"
        if self.security is None:
            text = _SERVER_PROPERTIES.format(
                host=self.host,
                port=self._port,
                controller_port=controller_port,
                data=workdir / "data",
            )
            scram: list[str] = []
        else:
            self.tls = await asyncio.to_thread(ThrowawayTLS.create, workdir / "tls", self.host)
            text = _secured_properties(
                host=self.host,
                port=self._port,
                internal_port=self._internal(),
                controller_port=controller_port,
                data=workdir / "data",
                tls=self.tls,
                security=self.security,
            )
            scram = _scram_arguments(self.security)
        properties.write_text(text)
        jvm = self._jvm = _jvm(java, lib, workdir, self.heap, self.request_log)
        if not (workdir / "data" / "meta.properties").exists():
            await _format_storage(jvm, properties, _new_cluster_id(), scram)
        return [*jvm, "kafka.Kafka", str(properties)]


@dataclass(frozen=True, slots=True)
class BrokerSecurity:
    """A SASL_SSL client listener with SCRAM-SHA-512 users and the standard authorizer.

    ``users`` maps user name to password; all are created when the storage is formatted.
    ``admin`` (which must be among them) is a super user, as is the brokers' own TLS
    principal ``User:CN=broker`` used between brokers and controllers. Every other user
    can do only what ACLs allow (``allow.everyone.if.no.acl.found=false``).
    """

    users: dict[str, str]
    admin: str = "admin"
    reauth_ms: int | None = None
    """``connections.max.reauth.ms``: the broker closes a SASL connection that has not
    re-authenticated within this time (aiokafka reconnects and logs in again). None: never."""

    def __post_init__(self) -> None:
        if self.admin not in self.users:
            raise ValueError(f"admin user {self.admin!r} is not among the users")


def _scram_arguments(security: BrokerSecurity) -> list[str]:
    arguments: list[str] = []
    for user, password in security.users.items():
        arguments += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
    return arguments


def _secured_properties(
    *,
    host: str,
    port: int,
    internal_port: int,
    controller_port: int,
    data: Path,
    tls: ThrowawayTLS,
    security: BrokerSecurity,
) -> str:
    return _SECURED_PROPERTIES.format(
        host=host,
        port=port,
        internal_port=internal_port,
        controller_port=controller_port,
        data=data,
        ca=tls.ca_file,
        keystore=tls.keystore_file,
        admin=security.admin,
    ) + (
        f"connections.max.reauth.ms={security.reauth_ms}\n"
        if security.reauth_ms is not None
        else ""
    )


def _client_settings(
    bootstrap: str,
    security: BrokerSecurity | None,
    tls: ThrowawayTLS | None,
    username: str | None,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"bootstrap_servers": bootstrap}
    if security is not None:
        assert tls is not None
        user = username or security.admin
        kwargs.update(
            security_protocol="SASL_SSL",
            sasl_mechanism="SCRAM-SHA-512",
            sasl_username=user,
            sasl_password=security.users.get(user, ""),
            ssl_cafile=str(tls.ca_file),
        )
    return {**kwargs, **overrides}


async def _wait_admin_ready(
    proc: subprocess.Popen[bytes],
    settings_kwargs: dict[str, Any],
    timeout: float,  # noqa: ASYNC109 - a startup deadline spanning many attempts
    *,
    brokers: int,
    log_tail: Any,
    name: str,
) -> None:
    """Poll with an authenticated admin client until ``brokers`` brokers are listed."""
    from aiokafka.errors import KafkaError

    from ._clients import make_admin, start_client
    from ._settings import Settings

    settings = Settings(**settings_kwargs)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last_error = "no answer yet"
    while True:
        code = proc.poll()
        if code is not None:
            raise BrokerStartError(f"{name} exited with code {code} during startup.\n{log_tail()}")
        admin = make_admin(settings, request_timeout_ms=5000)
        try:
            async with asyncio.timeout(10):
                await start_client(admin, grace=5.0, name="startup probe")
                cluster = await admin.describe_cluster()
            if len(cluster["brokers"]) >= brokers:
                return
            last_error = "metadata lists too few brokers"
        except (KafkaError, OSError, TimeoutError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        finally:
            await admin.close()
        if loop.time() >= deadline:
            raise BrokerStartError(
                f"{name} did not answer an authenticated Metadata request within "
                f"{timeout:.0f}s ({last_error}).\n{log_tail()}"
            )
        await asyncio.sleep(0.25)


# What every single-node broker shares: data, internal topics with one replica, quick groups
# (no wait for a first join; sessions down to 1 s, where Kafka's default floor is 6 s, so a
# local failover takes as long as the session a member asks for; an open transaction of a
# member that died is aborted within a second of its timeout, where Kafka looks every 10 s:
# a scheduler's partitions wait that long for it, see deferline.runners.member's producer).
# ``log.index.size.max.bytes``: each segment's offset and time indexes are sparse files of
# this size, mapped into memory. Where the disk's readahead is large (8 MB on some VMs), the
# first touch of an index page reads a readahead window of holes, which the kernel zeroes:
# with Kafka's 10 MB default, every partition that starts writing can cost up to 20 MB of
# memset (half the broker's CPU in a benchmark on fresh topics, docs/benchmarks.md). 256 KB
# still rolls a segment only after ~85 MB (an index entry per 4 KB of log).
_STORAGE_PROPERTIES = """\
log.dirs={data}
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
transaction.abort.timed.out.transaction.cleanup.interval.ms=1000
log.cleaner.backoff.ms=500
log.index.size.max.bytes=262144
"""

_SERVER_PROPERTIES = (
    """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@{host}:{controller_port}
listeners=PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}
advertised.listeners=PLAINTEXT://{host}:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
"""
    + _STORAGE_PROPERTIES
)


# Three listeners: clients authenticate with SASL/SCRAM over TLS; brokers and controllers
# talk over mutual TLS as User:CN=broker (a super user), so no broker secret is a password.
_SECURED_PROPERTIES = (
    """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@{host}:{controller_port}
listeners=CLIENT://{host}:{port},INTERNAL://{host}:{internal_port},CONTROLLER://{host}:{controller_port}
advertised.listeners=CLIENT://{host}:{port},INTERNAL://{host}:{internal_port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=INTERNAL
listener.security.protocol.map=CLIENT:SASL_SSL,INTERNAL:SSL,CONTROLLER:SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.client.sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.client.scram-sha-512.sasl.jaas.config=\\
  org.apache.kafka.common.security.scram.ScramLoginModule required;
ssl.keystore.type=PEM
ssl.keystore.location={keystore}
ssl.truststore.type=PEM
ssl.truststore.location={ca}
ssl.endpoint.identification.algorithm=https
listener.name.internal.ssl.client.auth=required
listener.name.controller.ssl.client.auth=required
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:{admin};User:CN=broker
auto.create.topics.enable=false
"""
    + _STORAGE_PROPERTIES
)
