"""Which brokers grant idempotent producers: Apache Kafka does, the embedded Tansu does not."""

import pytest
from deferline.topics import Settings, make_producer, supports_idempotence

pytestmark = pytest.mark.integration


@pytest.mark.brokers_differ("Tansu has no idempotent producer")
async def test_idempotence_is_detected_per_backend(settings: Settings, broker_backend: str) -> None:
    supported = await supports_idempotence(settings)
    assert supported is (broker_backend != "tansu")
    if supported:  # and an idempotent producer then really works
        producer = make_producer(settings.model_copy(update={"enable_idempotence": True}))
        await producer.start()
        try:
            from deferline.topics import ensure_topics, topic_specs

            await ensure_topics(settings, topic_specs(settings))
            await producer.send_and_wait(f"{settings.topic_prefix}dead", b"x", key=b"k")
        finally:
            await producer.stop()
