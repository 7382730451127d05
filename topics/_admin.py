"""Create and check deferline's topics (idempotent; co-partitioning is verified)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    KafkaError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    for_code,
)
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.structs import TopicPartition

from ._acls import AclBinding, Role, acl_bindings, create_acls
from ._clients import (
    is_bootstrap_failure,
    make_admin,
    make_consumer,
    principal_of,
    probe_access,
    start_client,
    stop_client,
)
from ._errors import AuthorizationError, BrokerError, TopicLayoutError, access_error
from ._names import TopicNames
from ._settings import Settings
from ._specs import TopicSpec, topic_specs

logger = logging.getLogger(__name__)

_NO_ERROR = 0
_TOPIC_EXISTS = TopicAlreadyExistsError.errno
_TOPIC_DENIED = TopicAuthorizationFailedError.errno
_VISIBLE_WITHIN_S = 30.0  # topic creation is asynchronous in Kafka


@dataclass(frozen=True, slots=True)
class TopicDescription:
    """A topic as the cluster reports it. ``config`` is empty when the broker cannot say."""

    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str] = field(default_factory=dict)


async def ensure_topics(
    settings: Settings, specs: Sequence[TopicSpec], *, strict: bool = False
) -> None:
    """Create the topics of ``specs`` that are missing, then check co-partitioning.

    Safe to run any number of times, concurrently too. When one side of a defer/resume pair
    already exists, the other is created with the existing side's partition count. Raises
    TopicLayoutError when an existing pair differs, BrokerError when the cluster refuses.

    A least-privilege principal may not describe every topic (Kafka hides those, existing or
    not): such topics are left to the administrator with a warning, unless ``strict``, or
    unless the principal may describe none of them; both raise AuthorizationError.
    """
    names = TopicNames(settings.topic_prefix)
    async with _started_admin(settings) as admin:
        existing = await _partition_counts(admin)
        unseen = [spec.name for spec in specs if spec.name not in existing]
        denied = await _denied_topics(admin, settings, unseen)
        if denied and (strict or len(denied) == len(specs)):
            raise _topic_denied(settings, denied, "describe")
        if denied:
            logger.info(
                "%s may not describe %s: left as they are (the administrator's to create)",
                principal_of(settings),
                ", ".join(denied),
                extra={"topics": denied, "principal": principal_of(settings)},
            )
        wanted = [spec for spec in specs if spec.name not in denied]
        missing = [
            _matched_to_partner(spec, names, existing)
            for spec in wanted
            if spec.name not in existing
        ]
        # Refuse before creating anything when the resulting layout would be broken.
        planned = {**existing, **{s.name: s.partitions for s in missing}}
        _check_pairs(names, [s.name for s in wanted], planned)
        if missing:
            await _create(admin, missing, settings)
            existing = await _wait_visible(admin, [s.name for s in missing])
            await _wait_writable(settings, {s.name: existing[s.name] for s in missing})
        _check_pairs(names, [s.name for s in wanted], existing)


async def describe_topics(
    settings: Settings,
    topics: Iterable[str] | None = None,
    *,
    prefix: str | None = None,
    configs: bool = True,
) -> list[TopicDescription]:
    """Describe ``topics``, or every topic under ``prefix`` (default: the topic prefix).

    Sorted by name; topics that do not exist are left out.
    """
    if prefix is None:
        prefix = settings.topic_prefix
    async with _started_admin(settings) as admin:
        if topics is not None:
            metadata = await _named_metadata(admin, settings, list(topics))
        else:
            try:
                metadata = await admin.describe_topics()
            except KafkaError as exc:
                raise _mapped(exc, settings, "cannot describe topics") from exc
            if prefix == settings.topic_prefix:
                # Kafka leaves topics the principal may not describe out of an all-topics
                # listing: ask for the default topics by name so that denial is not shown
                # as an empty system.
                await _named_metadata(admin, settings, [s.name for s in topic_specs(settings)])
        wanted = set(topics) if topics is not None else None
        found = {
            t["topic"]: t
            for t in metadata
            if t["error_code"] == _NO_ERROR
            and (t["topic"] in wanted if wanted is not None else t["topic"].startswith(prefix))
        }
        topic_configs = await _describe_configs(admin, sorted(found)) if configs else {}
        return [
            TopicDescription(
                name=name,
                partitions=len(found[name]["partitions"]),
                replication_factor=max(
                    (len(p["replicas"]) for p in found[name]["partitions"]), default=0
                ),
                config=topic_configs.get(name, {}),
            )
            for name in sorted(found)
        ]


@contextlib.asynccontextmanager
async def _started_admin(settings: Settings) -> AsyncIterator[AIOKafkaAdminClient]:
    """A started admin client, closed afterwards; connection failures become BrokerError."""
    client = make_admin(settings)
    try:
        try:
            await start_client(client, grace=5.0, name="admin")
        except (KafkaError, OSError) as exc:
            mapped = access_error(exc, principal=principal_of(settings))
            if mapped is None and is_bootstrap_failure(exc):
                mapped = await probe_access(settings)
            if mapped is not None:
                raise mapped from exc
            raise BrokerError(f"cannot reach Kafka at {settings.bootstrap_servers}: {exc}") from exc
        yield client
    finally:
        await client.close()


async def _partition_counts(
    admin: AIOKafkaAdminClient, *, with_leaders: bool = False
) -> dict[str, int]:
    """Partition count per topic; with ``with_leaders``, only topics whose partitions all
    have a leader (a new topic is not writable before that)."""
    # Metadata for *all* topics: asking for named topics may auto-create them.
    try:
        metadata = await admin.describe_topics()
    except KafkaError as exc:
        raise BrokerError(f"cannot read topic metadata: {exc}") from exc
    return {
        t["topic"]: len(t["partitions"])
        for t in metadata
        if t["error_code"] == _NO_ERROR
        and t["partitions"]
        and not (with_leaders and any(p["leader"] < 0 for p in t["partitions"]))
    }


def _matched_to_partner(spec: TopicSpec, names: TopicNames, existing: dict[str, int]) -> TopicSpec:
    partner = names.partner(spec.name)
    if partner is None or partner not in existing or existing[partner] == spec.partitions:
        return spec
    logger.warning(
        "creating %s with %d partitions to match existing %s (spec says %d)",
        spec.name,
        existing[partner],
        partner,
        spec.partitions,
        extra={"topic": spec.name, "partner": partner},
    )
    return TopicSpec(spec.name, existing[partner], spec.replication_factor, spec.config)


async def _named_metadata(
    admin: AIOKafkaAdminClient, settings: Settings, topics: list[str]
) -> list[Any]:
    """Metadata for ``topics`` by name, never auto-creating them.

    Raises AuthorizationError naming the topics this principal may not describe (Kafka
    answers TOPIC_AUTHORIZATION_FAILED for those, existing or not).
    """
    if not topics:
        return []
    try:
        # The admin client's describe_topics() cannot turn auto-creation off.
        response = await admin._client.send(
            admin._client.get_random_node(),
            MetadataRequest(topics, allow_auto_topic_creation=False),
        )
    except KafkaError as exc:
        raise _mapped(exc, settings, f"cannot read metadata of {topics}") from exc
    metadata: list[Any] = response.to_object()["topics"]
    denied = sorted(t["topic"] for t in metadata if t["error_code"] == _TOPIC_DENIED)
    if denied:
        raise _topic_denied(settings, denied, "describe")
    return metadata


async def _denied_topics(
    admin: AIOKafkaAdminClient, settings: Settings, topics: list[str]
) -> list[str]:
    """Which of ``topics`` this principal may not describe."""
    try:
        await _named_metadata(admin, settings, topics)
    except AuthorizationError as exc:
        return exc.resources
    return []


def _topic_denied(settings: Settings, topics: list[str], what: str) -> AuthorizationError:
    error = AuthorizationError(
        "not authorized: the broker answered TopicAuthorizationFailedError for topic "
        f"{', '.join(topics)}: {principal_of(settings) or 'this principal'} has no ACL "
        f"allowing it to {what} them. Grant the role's ACLs (docs/operations.md, "
        "`deferline topics ensure --acls ROLE=PRINCIPAL`).",
        resources=topics,
    )
    return error


def _mapped(exc: BaseException, settings: Settings, what: str) -> BrokerError:
    """An AccessError when ``exc`` is an authentication/authorization failure, else
    BrokerError("<what>: <exc>")."""
    return access_error(exc, principal=principal_of(settings)) or BrokerError(f"{what}: {exc}")


async def ensure_acls(
    settings: Settings,
    principals: dict[Role, str],
    *,
    queues: Iterable[str | None] = (),
    worker_queues: Iterable[str] = (),
) -> list[AclBinding]:
    """Create the least-privilege ACLs of each role's principal (see :func:`acl_bindings`).

    Needs a principal allowed to alter ACLs (Alter on the cluster, or a super user).
    Idempotent: Kafka keeps one copy of an ACL created twice. Returns the bindings.
    """
    bindings = acl_bindings(settings, principals, queues=queues, worker_queues=worker_queues)
    async with _started_admin(settings) as admin:
        try:
            await create_acls(admin, bindings)
        except BrokerError as exc:
            mapped = access_error(exc, principal=principal_of(settings))
            if mapped is not None:
                raise mapped from exc
            raise
    return bindings


async def _create(admin: AIOKafkaAdminClient, specs: list[TopicSpec], settings: Settings) -> None:
    new = [
        NewTopic(s.name, s.partitions, s.replication_factor, topic_configs=s.config) for s in specs
    ]
    try:
        response = await admin.create_topics(new)
    except KafkaError as exc:
        raise _mapped(exc, settings, f"cannot create topics {[s.name for s in specs]}") from exc
    failures = []
    denied = [
        e["topic"] for e in response.to_object()["topic_errors"] if e["error_code"] == _TOPIC_DENIED
    ]
    if denied:
        raise _topic_denied(settings, denied, "create")
    for entry in response.to_object()["topic_errors"]:
        code = entry["error_code"]
        if code in (_NO_ERROR, _TOPIC_EXISTS):
            if code == _NO_ERROR:
                logger.info("created topic %s", entry["topic"], extra={"topic": entry["topic"]})
            continue
        message = entry.get("error_message") or for_code(code).__name__
        failures.append(f"{entry['topic']}: {for_code(code).__name__}: {message}")
    if failures:
        raise BrokerError("cannot create topics: " + "; ".join(failures))


async def _wait_visible(admin: AIOKafkaAdminClient, topics: list[str]) -> dict[str, int]:
    """Poll metadata until the new topics show all partitions with leaders (creation is async)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _VISIBLE_WITHIN_S
    while True:
        counts = await _partition_counts(admin, with_leaders=True)
        pending = [t for t in topics if t not in counts]
        if not pending:
            return counts
        if loop.time() >= deadline:
            raise BrokerError(
                f"topics not visible in metadata after {_VISIBLE_WITHIN_S:.0f}s: {pending}"
            )
        await asyncio.sleep(0.1)


async def _wait_writable(settings: Settings, topics: dict[str, int]) -> None:
    """Return once every partition's leader answers ListOffsets.

    Metadata names a leader slightly before that broker has opened the partition; a produce
    in between fails with NotLeaderForPartition and is retried, which costs latency.
    """
    consumer = make_consumer(settings, request_timeout_ms=int(_VISIBLE_WITHIN_S * 1000))
    partitions = [TopicPartition(t, p) for t, n in topics.items() for p in range(n)]
    try:
        await start_client(consumer, grace=5.0, name="writability probe")
        await consumer.end_offsets(partitions)
    except KafkaError as exc:
        raise BrokerError(f"new topics did not become writable: {exc}") from exc
    finally:
        await stop_client(consumer, grace=5.0, name="topic writability probe")


def _check_pairs(names: TopicNames, topics: list[str], counts: dict[str, int]) -> None:
    problems = []
    seen: set[frozenset[str]] = set()
    for topic in topics:
        partner = names.partner(topic)
        if partner is None or frozenset((topic, partner)) in seen:
            continue
        seen.add(frozenset((topic, partner)))
        if topic in counts and partner in counts and counts[topic] != counts[partner]:
            problems.append(
                f"{topic} has {counts[topic]} partitions but {partner} has {counts[partner]}"
            )
    if problems:
        raise TopicLayoutError(
            "topic pairs are not co-partitioned: "
            + "; ".join(problems)
            + ". A key would map to different partitions in the two topics, so a triggerer "
            "could not find a trigger's events (defer/resume), or a task's events would not "
            "reach the scheduler owning the task (tasks/tasks.events). Recreate one of the two "
            "with the partition count of the other (adding partitions would also move "
            "existing keys)."
        )


async def _describe_configs(
    admin: AIOKafkaAdminClient, topics: list[str]
) -> dict[str, dict[str, str]]:
    if not topics:
        return {}
    resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in topics]
    try:
        responses = await admin.describe_configs(resources)
    except KafkaError as exc:
        logger.debug("describe_configs unsupported or failed: %s", exc)
        return {}
    result: dict[str, dict[str, str]] = {}
    for response in responses:
        for resource in _resources(response):
            if resource["error_code"] != _NO_ERROR:
                continue
            result[resource["resource_name"]] = {
                entry["config_names"]: entry["config_value"]
                for entry in resource["config_entries"]
                if entry["config_value"] is not None
            }
    return result


def _resources(response: Any) -> list[dict[str, Any]]:
    resources: list[dict[str, Any]] = response.to_object()["resources"]
    return resources
