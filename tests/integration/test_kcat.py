"""A DeferRequest produced with kcat, as docs/protocol.md shows, decodes and lands where
deferline.topics computes.

kcat linked with librdkafka older than 2.2 misreads the tagged fields of Tansu's ApiVersions
v3 reply (confluentinc/librdkafka#4278), so on Tansu it needs a newer kcat; Apache Kafka is
where this contract is checked on machines with Debian 12's kcat 1.7.1 / librdkafka 2.0.2.
"""

import asyncio
import re
import subprocess
import uuid
from asyncio.subprocess import PIPE, STDOUT
from pathlib import Path

import orjson
import pytest
from aiokafka.structs import ConsumerRecord
from deferline.schemas import DeferRequest, TaskKey, decode, encode, make_trigger_id
from deferline.topics import Settings, TopicNames, ensure_topics, partition_for, topic_specs

from tests._tools import system_program
from tests._until import until

pytestmark = pytest.mark.integration

PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
PARTITIONS = 12  # the docs' example states its partition for the default 12


@pytest.fixture(scope="session")
def kcat() -> str:
    return system_program("kcat", "kafkacat", package="kcat")


def _librdkafka(kcat: str) -> tuple[int, ...]:
    out = subprocess.run([kcat, "-V"], capture_output=True, text=True, check=False)
    found = re.search(r"librdkafka (\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    return tuple(int(x) for x in found.groups()) if found else (0, 0, 0)


def _documented_example() -> tuple[bytes, str]:
    """(JSON value, shell command) from docs/protocol.md, or one built from the model."""
    if PROTOCOL.exists():
        text = PROTOCOL.read_text()
        json_block = re.search(r"<!-- kcat-example -->\s*```json\n(.+?)\n```", text, re.DOTALL)
        command = re.search(r"```bash\n(echo .+?\| kcat -P .+?)\n```", text, re.DOTALL)
        assert json_block, "docs/protocol.md has no <!-- kcat-example --> JSON block"
        assert command, "docs/protocol.md has no `echo ... | kcat -P ...` command"
        return json_block.group(1).strip().encode(), command.group(1)
    task = TaskKey(dag_id="example_dag", task_id="wait", run_id="manual__1")
    request = DeferRequest(
        trigger_id=make_trigger_id(task, 0),
        task=task,
        classpath="deferline.engine.triggers.DateTimeTrigger",
        kwargs={"moment": "2030-01-01T00:00:00+00:00"},
    )
    value = encode(request)
    key = request.trigger_id
    return value, (
        f"echo '{key}|{value.decode()}' \\\n"
        "  | kcat -P -b localhost:9092 -t deferline.defer -K '|' -X partitioner=murmur2_random"
    )


async def test_documented_kcat_command_lands_on_partition_for(
    broker, broker_backend, kcat, kafka_clients
):
    if broker_backend == "tansu" and _librdkafka(kcat) < (2, 2, 0):
        version = ".".join(map(str, _librdkafka(kcat)))
        pytest.skip(
            f"kcat links librdkafka {version}, which cannot parse Tansu's ApiVersions reply "
            "(fixed in librdkafka 2.2, confluentinc/librdkafka#4278); checked on Apache Kafka"
        )
    value, command = _documented_example()
    request = decode(value)
    assert isinstance(request, DeferRequest)
    key = request.trigger_id.encode()
    assert "murmur2" in command, (
        "the documented kcat command must use a Java-compatible partitioner"
    )
    assert "-b localhost:9092" in command
    assert "-t deferline.defer" in command

    settings = Settings(
        bootstrap_servers=broker, topic_prefix=f"t{uuid.uuid4().hex[:12]}.", partitions=PARTITIONS
    )
    topic = TopicNames(settings.topic_prefix).defer()
    await ensure_topics(settings, [s for s in topic_specs(settings) if s.name == topic])

    command = command.replace("-b localhost:9092", f"-b {broker}")
    command = command.replace("-t deferline.defer", f"-t {topic}")
    proc = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", command, stdout=PIPE, stderr=STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, out.decode(errors="replace")

    consumer = await kafka_clients.consumer(topic)
    records: list[tuple[int, ConsumerRecord]] = []

    async def received() -> bool:
        batch = await consumer.getmany(timeout_ms=200)
        records.extend((tp.partition, r) for tp, rs in batch.items() for r in rs)
        return bool(records)

    await until(received, within=20, interval=0.05, what=f"the kcat record on {topic}")
    assert len(records) == 1, records
    partition, record = records[0]
    assert record.key == key
    assert partition == partition_for(key, PARTITIONS)
    assert decode(record.value) == request
    assert orjson.loads(record.value) == orjson.loads(value)
