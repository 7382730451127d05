"""Credentials that go bad under a running triggerer (Apache Kafka, SASL_SSL, ACLs).

A broker of its own, because it forces every SASL connection to re-authenticate every few
seconds (``connections.max.reauth.ms``), which aiokafka does by reconnecting: a rotated
password then takes effect on a running process, as it does in production at the next
reconnect.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

import pytest
from deferline.runners.triggerer import Triggerer, TriggererOptions
from deferline.schemas import DeferRequest
from deferline.topics import (
    ROLES,
    BrokerSecurity,
    KRaftBroker,
    Settings,
    TopicNames,
    ensure_acls,
    ensure_topics,
    make_producer,
    topic_specs,
)

from tests._until import until
from tests.conftest import SECURED_USERS, selected_backends

from ._triggerer_help import TopicReader, defer_request, produce_requests

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REAUTH_MS = 3000


def _fired(reader: TopicReader, requests: Sequence[DeferRequest]) -> bool:
    wanted = {r.trigger_id for r in requests}
    return wanted <= {e.trigger_id for e in reader.events() if e.status == "fired"}


async def test_a_password_rotated_under_a_running_triggerer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The triggerer logs the broker's reason, keeps retrying, and carries on with its state
    once the credential works again; nothing it was given is lost."""
    if "kafka" not in selected_backends():
        pytest.skip("needs the kafka backend")
    users = {user: f"{user}-secret" for user in SECURED_USERS}
    broker = KRaftBroker(heap="384m", security=BrokerSecurity(users=users, reauth_ms=REAUTH_MS))
    await broker.start()
    try:
        prefix = f"r{uuid.uuid4().hex[:8]}."
        admin = Settings(**broker.client_settings("admin", topic_prefix=prefix, partitions=2))
        triggerer = Settings(**broker.client_settings("triggerer", topic_prefix=prefix))
        await ensure_topics(admin, topic_specs(admin))
        await ensure_acls(admin, {role: f"User:{role}" for role in ROLES})
        names = TopicNames(prefix)
        producer = make_producer(admin)
        await producer.start()
        options = TriggererOptions(session_timeout_ms=10_000, checkpoint_interval=0.5)
        try:
            async with (
                TopicReader(admin, names.resume()) as reader,
                Triggerer(triggerer, options) as running,
            ):
                before = [defer_request(i, run="before") for i in range(20)]
                await produce_requests(producer, admin, before)
                await until(
                    lambda: _fired(reader, before), within=60, interval=0.05, what="fired before"
                )

                caplog.clear()
                with caplog.at_level(logging.WARNING):
                    await broker.set_password("triggerer", "rotated-elsewhere")
                    during = [defer_request(i, run="during", due_in=1.0) for i in range(20)]
                    await produce_requests(producer, admin, during)
                    await until(
                        lambda: (
                            "Authentication failed" in caplog.text
                            or "SaslAuthenticationFailed" in caplog.text
                        ),
                        within=REAUTH_MS / 1000 * 6,
                        interval=0.05,
                        what="the broker's reason is logged",
                    )
                    await broker.set_password("triggerer", users["triggerer"])
                    await until(
                        lambda: _fired(reader, during),
                        within=90,
                        interval=0.05,
                        what="fired after fix",
                    )
                assert running._fatal is None, running._fatal
                fired_before = {e.trigger_id for e in reader.events() if e.status == "fired"}
                assert {r.trigger_id for r in before} <= fired_before
        finally:
            await producer.stop()
    finally:
        await broker.stop()
