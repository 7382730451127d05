"""docker-compose.kafka.yml creates the same topics, with the same configs, as topic_specs()."""

import re
from pathlib import Path

from deferline.topics import KAFKA_VERSION, Settings, topic_specs

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.kafka.yml"


def test_compose_creates_every_default_topic_with_its_configs():
    text = COMPOSE.read_text()
    specs = topic_specs(Settings(bootstrap_servers="x:1", topic_prefix="deferline."))
    assert f"local partitions={Settings().partitions}" in text
    for spec in specs:
        line = re.search(rf"^\s*create {re.escape(spec.name)} (.+)$", text, re.MULTILINE)
        assert line, f"{spec.name} is not created in {COMPOSE.name}"
        args = line.group(1)
        if args.startswith('"$${') and args.endswith('[@]}"'):  # a shared config list
            group = args[len('"$${') : -len('[@]}"')]
            args = re.search(rf"^\s*{group}=\((.+)\)$", text, re.MULTILINE).group(1)  # type: ignore[union-attr]
        assert sorted(args.split()) == sorted(f"{k}={v}" for k, v in spec.config.items())


def test_compose_runs_the_kafka_version_the_tests_use():
    assert f"apache/kafka:{KAFKA_VERSION}" in COMPOSE.read_text()
