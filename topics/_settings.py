"""Connection and layout settings shared by every deferline process (``DEFERLINE_*``)."""

from __future__ import annotations

import json
import re
from contextvars import ContextVar
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

_PREFIX = re.compile(r"^[A-Za-z0-9._\-]*$")


def _split_list(value: Any) -> Any:
    """Accept ``a,b,c`` (or a JSON list) from the environment as well as a real list."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    """Frozen settings from keyword arguments, then ``DEFERLINE_*`` environment variables.

    List fields accept comma-separated environment values, e.g.
    ``DEFERLINE_KWARGS_KEYS=new-key,old-key``.
    """

    model_config = SettingsConfigDict(env_prefix="DEFERLINE_", frozen=True, extra="forbid")

    bootstrap_servers: str = "localhost:9092"
    """Comma-separated ``host:port`` list of brokers to bootstrap from."""
    client_id: str = "deferline"
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism = "PLAIN"
    """Used only when ``security_protocol`` is ``SASL_PLAINTEXT`` or ``SASL_SSL``."""
    sasl_username: str | None = None
    sasl_password: str | None = Field(default=None, repr=False)
    ssl_cafile: str | None = None
    """CA bundle that signed the brokers' certificates; the system CAs when unset."""
    ssl_certfile: str | None = None
    """Client certificate (mutual TLS)."""
    ssl_keyfile: str | None = None
    topic_prefix: str = "deferline."
    """Prepended to every topic name, so several deployments can share a cluster."""
    partitions: int = Field(default=12, ge=1)
    """Partitions of newly created topics (the unit of triggerer parallelism)."""
    replication_factor: int = Field(default=1, ge=1)
    """Replication factor of newly created topics; at 3 or more, topics also get
    ``min.insync.replicas=2`` so an acknowledged write (acks=all) survives losing a broker."""
    enable_idempotence: bool = False
    """Idempotent producers: a send retried after a leader change is written once. Apache
    Kafka only: the embedded Tansu broker has no idempotent producers, so it stays off by
    default; turn it on against Apache Kafka."""
    kwargs_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)
    """Fernet keys for trigger kwargs; the first encrypts, all decrypt. Empty: no encryption."""
    allowed_trigger_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["deferline.engine.triggers"]
    )
    """Module prefixes a trigger class must live under to be loaded."""
    allowed_operator_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["deferline.engine.examples"]
    )
    """Module prefixes an operator class must live under for a worker to run it."""
    copy_events_to_tasks: bool = True
    """Triggerers copy every event to ``tasks.events``, keyed by task, where deferline's
    scheduler folds it. Off only where no deferline scheduler reads the prefix (the
    triggerers of ``deferline airflow bridge``): each event is then produced once, not twice,
    and replay expects no copies."""

    airflow_services: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """URLs of the servers answering Airflow triggers' runtime requests (connections,
    variables, task and DAG-run state; on Airflow 3 XCom and human-in-the-loop too):
    ``deferline airflow bridge --services-port``. Tried in turn. Empty: a triggerer answers
    them itself from the environment and a secrets backend, and fails those only Airflow's
    database knows."""
    airflow_services_timeout: float = Field(default=30.0, gt=0)
    """Seconds an Airflow trigger's request waits while no server of ``airflow_services``
    answers anything (gone, frozen, refusing), retrying across them, before the trigger gets
    ``AirflowServicesUnavailable``; behind a backlog a server is working through, at most
    ten times that."""

    outage_limit: float = Field(default=300.0, gt=0)
    """Seconds a long-lived process (triggerer, scheduler, worker, Airflow bridge, console)
    rides out a Kafka cluster none of whose brokers answers: it waits, and starts again in
    place what failed, once a broker answers. Past it the process exits non-zero, naming
    the cause and the limit, for its orchestrator to restart it. Five minutes by default, as
    Kafka Streams' ``task.timeout.ms``."""

    @field_validator(
        "kwargs_keys",
        "allowed_trigger_prefixes",
        "allowed_operator_prefixes",
        "airflow_services",
        mode="before",
    )
    @classmethod
    def _lists_from_env(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("topic_prefix")
    @classmethod
    def _legal_prefix(cls, value: str) -> str:
        if not _PREFIX.match(value) or len(value) > 180:
            raise ValueError(
                "topic prefix may contain only letters, digits, '.', '_' and '-' "
                f"(at most 180 characters); got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _sasl_needs_credentials(self) -> Settings:
        if self.security_protocol.startswith("SASL_") and (
            not self.sasl_username or self.sasl_password is None
        ):
            raise ValueError(
                f"security_protocol={self.security_protocol} needs sasl_username and "
                "sasl_password (DEFERLINE_SASL_USERNAME / DEFERLINE_SASL_PASSWORD)"
            )
        return self


_HOME: ContextVar[Settings | None] = ContextVar("deferline_home_settings", default=None)


def use_home_settings(settings: Settings) -> None:
    """Make ``settings`` what :func:`home_settings` returns in this context and the tasks it
    starts from now on (a triggerer sets its own, for the triggers it runs)."""
    _HOME.set(settings)


def home_settings() -> Settings:
    """The settings of the deferline process this code runs in: its triggerer's cluster
    for a trigger; outside one, ``Settings()`` (``DEFERLINE_*`` environment variables)."""
    return _HOME.get() or Settings()
