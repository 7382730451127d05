"""docker-compose.kafka.yml creates the same topics, with the same configs, as topic_specs()."""

import re
from pathlib import Path

from deferline.topics import KAFKA_VERSION, ROLES, Settings, acl_bindings, topic_specs

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


def _secured_acls(text: str) -> set[tuple[str, str, str, str, str]]:
    """(principal, resource type, name, operation, pattern) for every `acl ROLE ...` line."""
    kinds = {"--topic": "TOPIC", "--group": "GROUP", "--transactional-id": "TRANSACTIONAL_ID"}
    operations = {
        "Read": "READ",
        "Write": "WRITE",
        "Describe": "DESCRIBE",
        "DescribeConfigs": "DESCRIBE_CONFIGS",
    }
    found = set()
    for line in re.findall(r"^\s*acl (\w+) (.+)$", text, re.MULTILINE):
        role, rest = line
        words = rest.replace("$${P}", "deferline.").split()
        ops = [operations[words[i + 1]] for i, w in enumerate(words) if w == "--operation"]
        targets = [(kinds[w], words[i + 1]) for i, w in enumerate(words) if w in kinds]
        pattern = "PREFIXED" if "--resource-pattern-type prefixed" in rest else "LITERAL"
        for op in ops:
            for kind, name in targets:
                found.add((f"User:deferline-{role}", kind, name, op, pattern))
    return found


def test_secured_profile_grants_exactly_the_acls_topics_ensure_creates():
    text = COMPOSE.read_text()
    settings = Settings(bootstrap_servers="x:1", topic_prefix="deferline.")
    expected = {
        (b.principal, b.resource_type, b.resource_name, b.operation, b.pattern)
        for b in acl_bindings(settings, {role: f"User:deferline-{role}" for role in ROLES})
    }
    assert _secured_acls(text) == expected


def test_secured_profile_creates_every_default_topic_and_a_user_per_role():
    text = COMPOSE.read_text()
    secured = text[text.index("kafka-secured-init:") :]
    for spec in topic_specs(Settings(bootstrap_servers="x:1", topic_prefix="deferline.")):
        assert re.search(rf"^\s*create {re.escape(spec.name)} ", secured, re.MULTILINE), spec.name
    assert "for role in " + " ".join(ROLES) + "; do" in secured
    assert "StandardAuthorizer" in text
    assert "KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND" in text
