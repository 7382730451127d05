"""Apache Kafka with SASL_SSL (SCRAM-SHA-512), the standard authorizer and per-role ACLs.

The ACLs come from ``deferline topics ensure --acls`` run as the admin; each test uses its
own topic prefix, so its ACLs cover only its own topics.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError
from click.testing import CliRunner, Result
from deferline.client import Client
from deferline.runners.cli import main
from deferline.runners.scheduler import Scheduler
from deferline.runners.triggerer import Triggerer, TriggererOptions
from deferline.runners.worker import Worker
from deferline.schemas import DeferRequest
from deferline.topics import (
    ROLES,
    BrokerError,
    ThrowawayTLS,
    TopicNames,
    acl_bindings,
    ensure_topics,
    make_admin,
    make_producer,
    topic_specs,
)
from deferline.topics.testing import create_acls

from tests.conftest import SecuredKafka

from ._taskflow import TaskFlow
from ._triggerer_help import TopicReader

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

EXAMPLES = "deferline.engine.examples"


def invoke(args: list[str]) -> Result:
    return CliRunner().invoke(main, args)


@pytest.fixture
def prefix(secured_kafka: SecuredKafka) -> str:
    """A fresh topic prefix with its topics created and every role's ACLs granted."""
    name = f"s{uuid.uuid4().hex[:10]}."
    acls = [f"--acls={role}=User:{role}" for role in ROLES]
    result = invoke(
        ["topics", "ensure", *secured_kafka.flags("admin", prefix=name), "--partitions", "2", *acls]
    )
    assert result.exit_code == 0, result.output
    assert f"ACL User:worker WRITE TOPIC {name}defer" in result.output
    return name


def test_the_full_loop_runs_with_each_role_its_own_principal(
    secured_kafka: SecuredKafka, prefix: str
) -> None:
    """client submits, scheduler/worker/triggerer each as their own principal: it completes,
    and the triggerer deletes the finished trigger from the defer table (its tombstone)."""

    async def scenario() -> None:
        as_ = {role: secured_kafka.settings(role, prefix=prefix) for role in ROLES}
        options = TriggererOptions(session_timeout_ms=6000, checkpoint_interval=0.5)
        async with (
            TopicReader(as_["replay"], TopicNames(prefix).defer()) as table,
            TaskFlow(as_["replay"]) as flow,
            Scheduler(as_["scheduler"], orphan_check_interval=0.5, commit_interval=0.2) as sched,
            Triggerer(as_["triggerer"], options),
            Worker(as_["worker"], slots=2, poll_interval=0.02, graceful_timeout=5.0),
            Client(as_["client"]) as client,
        ):
            await sched.wait_ready()
            key = await client.submit(
                f"{EXAMPLES}.WaitOperator",
                dag_id="secured",
                task_id="wait",
                run_id="run1",
                op_kwargs={"seconds": 0.2, "result": {"ok": True}},
            )
            done = await flow.wait_state(key, "success")
            assert done.xcoms == {"return_value": {"ok": True}}
            assert len(flow.runs_of(key, "resume")) == 1
            (request,) = await flow.wait_for(
                lambda: [v for v in table.values() if isinstance(v, DeferRequest)]
            )
            await flow.wait_for(lambda: request.trigger_id.encode() in table.tombstones())

    asyncio.run(scenario())


async def _write_refused(secured: SecuredKafka, user: str, prefix: str, topic: str) -> bool:
    producer = make_producer(secured.settings(user, prefix=prefix), request_timeout_ms=10_000)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"forged", key=b"k")
    except TopicAuthorizationFailedError:
        return True
    except KafkaError as exc:
        raise AssertionError(f"{user} writing {topic}: {type(exc).__name__}: {exc}") from exc
    finally:
        await producer.stop()
    return False


def test_each_role_can_write_only_its_own_topics(secured_kafka: SecuredKafka, prefix: str) -> None:
    names = TopicNames(prefix)

    async def scenario() -> None:
        # The trust boundary: only worker, scheduler, client and triggerer (its tombstones)
        # may write a defer topic.
        assert await _write_refused(secured_kafka, "replay", prefix, names.defer())
        assert await _write_refused(secured_kafka, "triggerer", prefix, names.tasks)
        assert not await _write_refused(secured_kafka, "worker", prefix, names.defer())
        # A worker publishes no trigger events and no RunTasks.
        assert await _write_refused(secured_kafka, "worker", prefix, names.resume())
        assert await _write_refused(secured_kafka, "worker", prefix, names.task_events)
        assert await _write_refused(secured_kafka, "worker", prefix, names.resumes())
        assert await _write_refused(secured_kafka, "client", prefix, names.resume())
        assert await _write_refused(secured_kafka, "client", prefix, names.task_events)
        # The Airflow bridge publishes requests; it writes no event and no task state.
        assert not await _write_refused(secured_kafka, "bridge", prefix, names.defer())
        for topic in (names.resume(), names.task_events, names.tasks, names.work()):
            assert await _write_refused(secured_kafka, "bridge", prefix, topic), topic
        # replay is read-only.
        for topic in (names.tasks, names.resume(), names.task_events, names.work(), names.dead):
            assert await _write_refused(secured_kafka, "replay", prefix, topic), topic

    asyncio.run(scenario())


def _commands(prefix: str) -> list[list[str]]:
    return [
        ["topics", "list"],
        ["topics", "ensure"],
        ["tasks"],
        ["submit", f"{EXAMPLES}.WaitOperator", "--dag-id", "d", "--task-id", "t"],
        ["clear", "d/t/run1"],
        ["replay", "stuck"],
        ["replay", "why", "d/t/run1"],
        ["replay", "timeline", "d/t/run1"],
        ["replay", "redrive", "a-trigger-id", "--dry-run"],
        ["replay", "redrive", "a-trigger-id"],
        ["replay", "run", "a-trigger-id"],
    ]


@pytest.mark.parametrize("user", ["noacl", "wrong-password"])
def test_every_command_names_a_refused_principal(
    secured_kafka: SecuredKafka, prefix: str, user: str
) -> None:
    """No ACLs, or a wrong password: each command exits non-zero with the broker's reason,
    never a traceback and never an empty result."""
    if user == "noacl":
        flags = secured_kafka.flags("noacl", prefix=prefix)
        expected: tuple[str, ...] = ("AuthorizationError", "AuthorizationFailed", "User:noacl")
    else:
        flags = secured_kafka.flags("client", prefix=prefix, password="not-the-password")
        expected = ("AuthenticationError", "SaslAuthenticationFailed")
    for command in _commands(prefix):
        args = (
            [*command[:2], *flags, *command[2:]]
            if command[0] in ("topics", "replay")
            else [
                *command,
                *flags,
            ]
        )
        result = invoke(args)
        assert result.exit_code != 0, (command, result.output)
        assert not isinstance(result.exception, Exception) or isinstance(
            result.exception, SystemExit
        ), (command, result.output)
        for word in expected:
            assert word in result.output, (command, word, result.output)
        assert "Traceback" not in result.output
        assert "0 task(s)" not in result.output
        assert "no topics" not in result.output


def test_an_untrusted_ca_fails_tls_with_a_clear_error(
    secured_kafka: SecuredKafka, prefix: str, tmp_path: Path
) -> None:
    other = ThrowawayTLS.create(tmp_path, "127.0.0.1")
    flags = secured_kafka.flags("admin", prefix=prefix)
    flags[flags.index("--ssl-cafile") + 1] = str(other.ca_file)
    result = invoke(["topics", "list", *flags])
    assert result.exit_code == 1, result.output
    assert "AuthenticationError" in result.output
    assert "CERTIFICATE_VERIFY_FAILED" in result.output or "certificate verify" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("process", ["triggerer", "scheduler", "worker"])
def test_a_process_without_acls_stops_at_start_naming_why(
    secured_kafka: SecuredKafka, prefix: str, process: str
) -> None:
    deferline = str(Path(sys.executable).with_name("deferline"))
    result = subprocess.run(
        [deferline, process, *secured_kafka.flags("noacl", prefix=prefix)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0, result.stderr
    assert "TopicAuthorizationFailedError" in result.stderr
    assert "User:noacl" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_scheduler_that_may_not_read_the_events_topic_names_it_and_exits(
    secured_kafka: SecuredKafka,
) -> None:
    """Kafka hides a topic the principal may not describe: without care the scheduler would
    take "no tasks.events topic" for "none created yet" and wait forever."""
    name = f"s{uuid.uuid4().hex[:10]}."
    admin = secured_kafka.settings("admin", prefix=name)
    events = TopicNames(name).task_events

    async def grant_all_but_events() -> None:
        await ensure_topics(admin, topic_specs(admin))
        bindings = acl_bindings(admin, {"scheduler": "User:noacl"})
        assert any(b.resource_name == events for b in bindings)
        client = make_admin(admin)
        await client.start()
        try:
            await create_acls(client, [b for b in bindings if b.resource_name != events])
        finally:
            await client.close()

    asyncio.run(grant_all_but_events())
    deferline = str(Path(sys.executable).with_name("deferline"))
    result = subprocess.run(
        [deferline, "scheduler", *secured_kafka.flags("noacl", prefix=name)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0, result.stderr
    assert "AuthorizationError" in result.stderr
    assert events in result.stderr
    assert "User:noacl" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_principal_that_may_not_alter_acls_gets_each_refused_binding_named(
    secured_kafka: SecuredKafka, prefix: str
) -> None:
    """CreateAcls carries every binding in one request; the broker answers each, and the
    error names each one it refused (the worker may not alter the cluster's ACLs)."""
    worker = secured_kafka.settings("worker", prefix=prefix)
    bindings = acl_bindings(worker, {"replay": "User:replay"})
    assert len(bindings) > 1

    async def create() -> None:
        client = make_admin(worker)
        await client.start()
        try:
            await create_acls(client, bindings)
        finally:
            await client.close()

    with pytest.raises(BrokerError) as refused:
        asyncio.run(create())
    for b in bindings:
        named = f"{b.principal} {b.operation} {b.resource_type} {b.resource_name}: "
        assert f"{named}ClusterAuthorizationFailedError" in str(refused.value), b
