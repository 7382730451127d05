"""Role ACLs and the naming of authentication/authorization failures (no broker)."""

import ssl

import pytest
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
)
from deferline.topics import (
    ROLES,
    AuthenticationError,
    AuthorizationError,
    BrokerError,
    SchedulerResources,
    Settings,
    TopicNames,
    access_error,
    acl_bindings,
    parse_role_principals,
)
from deferline.topics.testing import is_bootstrap_failure

SETTINGS = Settings(bootstrap_servers="x:1", topic_prefix="p.")
NAMES = TopicNames("p.")


def grants(role: str, **queues: object) -> set[tuple[str, str, str]]:
    bindings = acl_bindings(SETTINGS, {role: f"User:{role}"}, **queues)  # type: ignore[arg-type, dict-item]
    return {(b.resource_type, b.resource_name, b.operation) for b in bindings}


def writes(role: str, **queues: object) -> set[str]:
    return {name for kind, name, op in grants(role, **queues) if kind == "TOPIC" and op == "WRITE"}


def test_only_workers_the_scheduler_clients_bridges_and_triggerers_may_write_a_defer_topic() -> (
    None
):
    # Triggerers write the tombstones of finished triggers there; replay never writes.
    writers = {role for role in ROLES if NAMES.defer() in writes(role)}
    assert writers == {"worker", "scheduler", "client", "bridge", "triggerer"}
    assert NAMES.tasks not in writes("triggerer")


def test_the_bridge_publishes_requests_and_reads_events_and_log_lines_only() -> None:
    assert writes("bridge", queues=["fast"]) == {NAMES.defer(), NAMES.defer("fast"), NAMES.dead}
    assert grants("bridge") >= {
        ("TOPIC", NAMES.resume(), "READ"),
        ("TOPIC", NAMES.trigger_logs, "READ"),
        ("GROUP", "p.bridge", "READ"),
    }
    assert NAMES.trigger_logs in writes("triggerer")


def test_a_worker_never_writes_events_or_run_tasks() -> None:
    assert writes("worker") == {NAMES.tasks, NAMES.defer(), NAMES.dead}


def test_replay_writes_nothing() -> None:
    assert all(op in ("READ", "DESCRIBE_CONFIGS", "DESCRIBE") for _, _, op in grants("replay"))
    assert ("GROUP", "p.triggerer", "DESCRIBE") in grants("replay")
    assert ("GROUP", "p.scheduler", "DESCRIBE") in grants("replay")


def test_queues_extend_the_rules_to_their_topics_and_groups() -> None:
    triggerer = grants("triggerer", queues=["fast"], worker_queues=["gpu"])
    assert ("TOPIC", NAMES.defer("fast"), "READ") in triggerer
    assert ("TOPIC", NAMES.resume("fast"), "WRITE") in triggerer
    assert ("TOPIC", NAMES.resumes("gpu"), "WRITE") in triggerer
    assert ("GROUP", "p.triggerer.fast", "READ") in triggerer
    assert ("GROUP", "p.worker.gpu", "READ") in grants("worker", worker_queues=["gpu"])


def test_the_scheduler_may_use_its_group_and_every_member_transactional_id() -> None:
    names = SchedulerResources.for_prefix("p.")
    scheduler = grants("scheduler")
    assert ("GROUP", names.group, "READ") in scheduler
    assert names.transactional_id_prefix == "p.scheduler.member."
    ids = [
        b
        for b in acl_bindings(SETTINGS, {"scheduler": "User:s"})
        if b.resource_type == "TRANSACTIONAL_ID"
    ]
    assert {(b.resource_name, b.operation, b.pattern) for b in ids} == {
        ("p.scheduler.member.", "WRITE", "PREFIXED"),
        ("p.scheduler.member.", "DESCRIBE", "PREFIXED"),
    }, "one prefixed binding covers every scheduler process's id, and nothing else"
    assert (
        ids[0]
        .kafka_acls_command("b:9")
        .endswith("--transactional-id p.scheduler.member. --resource-pattern-type prefixed")
    )


def test_a_triggerer_may_use_every_member_transactional_id_of_each_queues_group() -> None:
    ids = [
        b
        for b in acl_bindings(SETTINGS, {"triggerer": "User:t"}, queues=["fast"])
        if b.resource_type == "TRANSACTIONAL_ID"
    ]
    assert {(b.resource_name, b.operation, b.pattern) for b in ids} == {
        (f"{group}.member.", operation, "PREFIXED")
        for group in ("p.triggerer", "p.triggerer.fast")
        for operation in ("WRITE", "DESCRIBE")
    }, "one prefixed binding per group covers every triggerer process's id, and nothing else"


def test_role_principals_are_parsed_or_refused_clearly() -> None:
    assert parse_role_principals(["worker=w", "replay=User:r"]) == {
        "worker": "User:w",
        "replay": "User:r",
    }
    with pytest.raises(ValueError, match="ROLE=PRINCIPAL"):
        parse_role_principals(["admin=User:a"])
    with pytest.raises(ValueError, match="ROLE=PRINCIPAL"):
        parse_role_principals(["worker"])


def test_kafka_acls_command_spells_the_binding() -> None:
    binding = acl_bindings(SETTINGS, {"client": "User:c"})[0]
    assert binding.kafka_acls_command("b:9") == (
        "kafka-acls.sh --bootstrap-server b:9 --command-config admin.properties --add "
        "--allow-principal User:c --operation Read --topic p.tasks"
    )


def test_an_authorization_failure_is_named_with_resource_and_principal() -> None:
    try:
        raise BrokerError("cannot read") from TopicAuthorizationFailedError("p.tasks")
    except BrokerError as exc:
        mapped = access_error(exc, principal="User:bob")
    assert isinstance(mapped, AuthorizationError)
    text = str(mapped)
    assert "TopicAuthorizationFailedError" in text
    assert "topic p.tasks" in text
    assert "User:bob" in text

    group = access_error(GroupAuthorizationFailedError("p.triggerer"))
    assert isinstance(group, AuthorizationError)
    assert "group p.triggerer" in str(group)


def test_authentication_and_tls_failures_are_named() -> None:
    sasl = access_error(SaslAuthenticationFailed("invalid credentials"), principal="User:c")
    assert isinstance(sasl, AuthenticationError)
    assert "SaslAuthenticationFailed" in str(sasl)
    assert "invalid credentials" in str(sasl)
    tls = access_error(ssl.SSLCertVerificationError(1, "certificate verify failed"))
    assert isinstance(tls, AuthenticationError)
    assert "certificate verify failed" in str(tls)


def test_other_failures_are_left_alone() -> None:
    assert access_error(BrokerError("topic layout")) is None
    bootstrap = BrokerError("no")
    bootstrap.__cause__ = KafkaConnectionError("Unable to bootstrap")
    assert access_error(bootstrap) is None
    assert is_bootstrap_failure(bootstrap)
    assert not is_bootstrap_failure(BrokerError("x"))
