"""Least-privilege ACLs per role: which principal may read, write or describe what.

The trust boundary of the design is "who may write to a defer topic": whoever can, can make
a triggerer run any allowed trigger class. So only workers, the scheduler (cancels),
clients (start-from-trigger, clear) and the triggerers get Write there, and the broker
enforces it. A triggerer writes only tombstones there (the defer topic is a table: a
finished trigger's entry is deleted by its owner), but Kafka cannot grant Write for
tombstones alone; a triggerer's principal runs the triggers anyway.

Every binding names an exact topic or group (LITERAL), built from the same
TopicNames/topic_specs the processes use, so a new queue needs ``topics ensure --acls``
again with that queue. One kind is PREFIXED: the transactional ids of the triggerers and
schedulers, one per member process of each group (``<group>.member.<name>``), whose names
are not known in advance.
:func:`acl_bindings` is the single list; ``topics ensure --acls``, the docs' ``kafka-acls``
commands and the tests all come from it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError, KafkaError, for_code
from aiokafka.protocol.admin import CreateAclsRequest, CreateAclsRequestStruct

from ._errors import BrokerError
from ._names import DEFAULT_QUEUE, TopicNames
from ._settings import Settings

logger = logging.getLogger(__name__)

Role = Literal["worker", "triggerer", "scheduler", "client", "bridge", "replay"]
ROLES: tuple[Role, ...] = get_args(Role)

ResourceType = Literal["TOPIC", "GROUP", "TRANSACTIONAL_ID", "CLUSTER"]
PatternType = Literal["LITERAL", "PREFIXED"]
Operation = Literal["READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS", "IDEMPOTENT_WRITE"]

# Kafka's wire codes (org.apache.kafka.common.resource / acl).
_RESOURCE_CODES = {"TOPIC": 2, "GROUP": 3, "CLUSTER": 4, "TRANSACTIONAL_ID": 5}
_OPERATION_CODES = {
    "READ": 3,
    "WRITE": 4,
    "DESCRIBE": 8,
    "DESCRIBE_CONFIGS": 10,
    "IDEMPOTENT_WRITE": 12,
}
_PATTERN_CODES = {"LITERAL": 3, "PREFIXED": 4}
_ALLOW = 3
_CLI_OPERATION = {
    "READ": "Read",
    "WRITE": "Write",
    "DESCRIBE": "Describe",
    "DESCRIBE_CONFIGS": "DescribeConfigs",
    "IDEMPOTENT_WRITE": "IdempotentWrite",
}


@dataclass(frozen=True, slots=True)
class AclBinding:
    """One ALLOW rule: ``principal`` may do ``operation`` on a named resource, from any host."""

    principal: str
    resource_type: ResourceType
    resource_name: str
    operation: Operation
    pattern: PatternType = "LITERAL"

    def kafka_acls_command(self, bootstrap: str = "$BOOTSTRAP") -> str:
        """The equivalent ``kafka-acls.sh`` command line."""
        target = {
            "TOPIC": f"--topic {self.resource_name}",
            "GROUP": f"--group {self.resource_name}",
            "TRANSACTIONAL_ID": f"--transactional-id {self.resource_name}",
            "CLUSTER": "--cluster",
        }[self.resource_type]
        pattern = " --resource-pattern-type prefixed" if self.pattern == "PREFIXED" else ""
        return (
            f"kafka-acls.sh --bootstrap-server {bootstrap} --command-config admin.properties "
            f"--add --allow-principal {self.principal} "
            f"--operation {_CLI_OPERATION[self.operation]} {target}{pattern}"
        )


@dataclass(frozen=True, slots=True)
class SchedulerResources:
    """The scheduler's group and transactional ids, named in one place.

    Every scheduler is a member of the group; on Apache Kafka each writes through a
    transactional id of its own, ``<group>.member.<name>`` (its static instance id, or a
    name drawn at start; see deferline.runners.member.MemberProducer): the ids begin with
    ``transactional_id_prefix``. Both follow the topic prefix.
    """

    group: str
    transactional_id_prefix: str

    @classmethod
    def for_prefix(cls, prefix: str) -> SchedulerResources:
        group = f"{prefix}scheduler"
        return cls(group=group, transactional_id_prefix=f"{group}.member.")


def principal(name: str) -> str:
    """``alice`` → ``User:alice``; a name that already has a type is kept."""
    return name if ":" in name else f"User:{name}"


def acl_bindings(
    settings: Settings,
    principals: Mapping[Role, str],
    *,
    queues: Iterable[str | None] = (),
    worker_queues: Iterable[str] = (),
) -> list[AclBinding]:
    """The ALLOW rules each role's principal needs, for the default and the given queues.

    READ and WRITE imply DESCRIBE in Kafka, so DESCRIBE is listed only where nothing else is.
    IdempotentWrite on the cluster is not needed: since Kafka 3.0 Write on a topic allows
    idempotent produce to it.
    """
    names = TopicNames(settings.topic_prefix)
    prefix = settings.topic_prefix
    trigger_queues = list(dict.fromkeys((None, *(q or None for q in queues))))
    wqueues = list(dict.fromkeys((DEFAULT_QUEUE, *worker_queues)))
    defer = [names.defer(q) for q in trigger_queues]
    resume = [names.resume(q) for q in trigger_queues]
    work = [names.work(w) for w in wqueues]
    resumes = [names.resumes(w) for w in wqueues]
    triggerer_groups = [
        f"{prefix}triggerer" + ("" if q in (None, DEFAULT_QUEUE) else f".{q}")
        for q in trigger_queues
    ]
    # On Apache Kafka each member of a triggerer group writes through <group>.member.<name>
    # (deferline.runners.member.MemberProducer).
    triggerer_txns = [f"{g}.member." for g in triggerer_groups]
    worker_groups = [f"{prefix}worker.{w}" for w in wqueues]
    logs = names.trigger_logs
    scheduler = SchedulerResources.for_prefix(prefix)
    pools = names.scheduler_pools
    all_topics = [
        *defer,
        *resume,
        names.tasks,
        names.task_events,
        *work,
        *resumes,
        names.dead,
        pools,
    ]

    grants: dict[Role, list[tuple[ResourceType, Iterable[str], Operation]]] = {
        # Runs tasks: takes RunTasks, folds and writes task state, publishes DeferRequests,
        # dead-letters unreadable work. Never writes events (resume) or RunTasks.
        "worker": [
            ("TOPIC", [*work, *resumes, names.tasks], "READ"),
            ("TOPIC", [names.tasks, *defer, names.dead], "WRITE"),
            ("GROUP", worker_groups, "READ"),
        ],
        # Runs triggers: reads DeferRequests, writes events (on its resume topic and on
        # tasks.events, and direct resumes) and the tombstones of finished triggers (defer),
        # scans its resume topic on recovery, dead-letters bad requests. Never writes tasks.
        "triggerer": [
            ("TOPIC", [*defer, *resume], "READ"),
            ("TOPIC", [*resume, names.task_events, *defer, *resumes, names.dead, logs], "WRITE"),
            ("GROUP", triggerer_groups, "READ"),
        ],
        # Folds events into task state; writes state, RunTasks, cancels and dead letters;
        # reads and writes the pool ledger (wants of its tasks; grants, as the ledger owner).
        "scheduler": [
            ("TOPIC", [names.task_events, names.tasks, pools], "READ"),
            ("TOPIC", [names.tasks, *work, *resumes, *defer, names.dead, pools], "WRITE"),
            ("GROUP", [scheduler.group], "READ"),
        ],
        # submit / tasks / clear: task state, and defer for start-from-trigger and cancels.
        "client": [
            ("TOPIC", [names.tasks], "READ"),
            ("TOPIC", [names.tasks, *defer], "WRITE"),
        ],
        # The Airflow bridge: publishes Airflow's trigger rows (defer: requests, cancels,
        # tombstones of watches), reads their events and the triggers' log lines, dead-letters
        # unreadable events. Never writes events, task state or RunTasks.
        "bridge": [
            ("TOPIC", [*resume, logs], "READ"),
            ("TOPIC", [*defer, names.dead], "WRITE"),
            ("GROUP", [f"{prefix}bridge"], "READ"),
        ],
        # replay: reads everything, writes nothing; sees topic configs and group positions.
        "replay": [
            ("TOPIC", all_topics, "READ"),
            ("TOPIC", all_topics, "DESCRIBE_CONFIGS"),
            ("GROUP", [*triggerer_groups, scheduler.group, *worker_groups], "DESCRIBE"),
        ],
    }
    prefixed: dict[Role, list[tuple[ResourceType, str, Operation]]] = {
        "triggerer": [
            ("TRANSACTIONAL_ID", txn, operation)
            for txn in triggerer_txns
            for operation in ("WRITE", "DESCRIBE")
        ],
        "scheduler": [
            ("TRANSACTIONAL_ID", scheduler.transactional_id_prefix, "WRITE"),
            ("TRANSACTIONAL_ID", scheduler.transactional_id_prefix, "DESCRIBE"),
        ],
    }
    bindings: list[AclBinding] = []
    for role, who in principals.items():
        if role not in grants:
            raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
        for resource_type, resources, operation in grants[role]:
            for resource in dict.fromkeys(resources):
                bindings.append(AclBinding(principal(who), resource_type, resource, operation))
        for resource_type, start, operation in prefixed.get(role, []):
            bindings.append(
                AclBinding(principal(who), resource_type, start, operation, pattern="PREFIXED")
            )
    return list(dict.fromkeys(bindings))


class _CreateAcls(CreateAclsRequest):  # type: ignore[misc]  # aiokafka is untyped here
    """CreateAcls with every binding in one request (aiokafka's request carries one)."""

    def __init__(self, bindings: list[AclBinding]) -> None:
        self._bindings = bindings

    def build(self, request_struct_class: type[CreateAclsRequestStruct]) -> CreateAclsRequestStruct:
        with_pattern = request_struct_class.API_VERSION >= 1
        if not with_pattern and any(b.pattern != "LITERAL" for b in self._bindings):
            raise BrokerError("the broker takes no prefixed ACLs (CreateAcls v1, Kafka 2.0+)")
        return request_struct_class(
            [
                (
                    _RESOURCE_CODES[b.resource_type],
                    b.resource_name,
                    *((_PATTERN_CODES[b.pattern],) if with_pattern else ()),
                    b.principal,
                    "*",
                    _OPERATION_CODES[b.operation],
                    _ALLOW,
                )
                for b in self._bindings
            ]
        )


# A broker enforcing connections.max.reauth.ms closes a connection whose session has ended
# (aiokafka does not re-authenticate); the request is sent again on a new one.
_ATTEMPTS = 3


async def create_acls(admin: AIOKafkaAdminClient, bindings: Iterable[AclBinding]) -> int:
    """Create ``bindings`` through the admin API (CreateAcls, all in one request); existing
    ones are kept, so a request sent again on a closed connection changes nothing twice.

    Returns how many were sent. Raises BrokerError naming every binding the broker refused
    (e.g. ClusterAuthorizationFailed when the caller may not alter ACLs, or
    SecurityDisabled when the broker has no authorizer).
    """
    wanted = list(bindings)
    if not wanted:
        return 0
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            # aiokafka 0.14's admin client has no create_acls: send the request it defines.
            response = await admin._client.send(
                admin._client.get_random_node(), _CreateAcls(wanted)
            )
            break
        except KafkaConnectionError as exc:
            if attempt == _ATTEMPTS:
                raise BrokerError(f"cannot create ACLs: {type(exc).__name__}: {exc}") from exc
            logger.info("creating ACLs again: %s", exc)
        except KafkaError as exc:
            raise BrokerError(f"cannot create ACLs: {type(exc).__name__}: {exc}") from exc
    failures = [
        f"{b.principal} {b.operation} {b.resource_type} {b.resource_name}: "
        f"{for_code(result['error_code']).__name__}: {result['error_message'] or ''}".rstrip()
        for b, result in zip(wanted, response.to_object()["creation_responses"], strict=True)
        if result["error_code"]
    ]
    if failures:
        raise BrokerError("cannot create ACLs: " + "; ".join(failures))
    logger.info("created %d ACL bindings", len(wanted), extra={"acls": len(wanted)})
    return len(wanted)


def parse_role_principals(values: Iterable[str]) -> dict[Role, str]:
    """``["worker=User:w", "replay=r"]`` → ``{"worker": "User:w", "replay": "User:r"}``."""
    result: dict[Role, str] = {}
    for value in values:
        role, sep, who = value.partition("=")
        role = role.strip()
        if not sep or not who.strip() or role not in ROLES:
            raise ValueError(
                f"{value!r}: use ROLE=PRINCIPAL with ROLE one of {', '.join(ROLES)} "
                "(e.g. worker=User:deferline-worker)"
            )
        result[role] = principal(who.strip())
    return result
