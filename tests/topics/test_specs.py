from typing import Any

import pytest
from deferline.topics import InvalidQueueName, Settings, TopicNames, TopicSpec, topic_specs


def _by_name(settings: Settings, **kwargs: Any) -> dict[str, TopicSpec]:
    return {spec.name: spec for spec in topic_specs(settings, **kwargs)}


def test_default_layout():
    settings = Settings(topic_prefix="d.", partitions=6, replication_factor=3)
    specs = _by_name(settings)
    assert sorted(specs) == sorted(
        [
            "d.defer",
            "d.resume",
            "d.tasks",
            "d.tasks.events",
            "d.queue",
            "d.queue.resumes",
            "d.dead",
            "d.scheduler.pools",
        ]
    )
    pools = specs.pop("d.scheduler.pools")
    assert (pools.partitions, pools.replication_factor) == (1, 3), "one ledger, one order"
    assert pools.config["cleanup.policy"] == "compact"
    assert pools.config["min.insync.replicas"] == "2"
    assert {(s.partitions, s.replication_factor) for s in specs.values()} == {(6, 3)}


def test_tables_are_compacted_and_streams_are_retained_by_time():
    specs = _by_name(Settings(topic_prefix="d."))
    for table in ("d.defer", "d.tasks"):
        config = specs[table].config
        assert config["cleanup.policy"] == "compact"
        assert int(config["min.compaction.lag.ms"]) > 0
        assert int(config["delete.retention.ms"]) >= 3_600_000  # tombstones outlive a lag
    for stream in ("d.resume", "d.tasks.events", "d.queue", "d.queue.resumes", "d.dead"):
        config = specs[stream].config
        assert config["cleanup.policy"] == "delete"
        assert int(config["retention.ms"]) >= 7 * 24 * 3_600_000


def test_queues_add_co_partitioned_pairs_and_worker_topics():
    settings = Settings(topic_prefix="d.", partitions=5)
    specs = _by_name(settings, queues=["fast", "slow", "fast"], worker_queues=["gpu"])
    names = TopicNames("d.")
    for queue in (None, "fast", "slow"):
        defer, resume = specs[names.defer(queue)], specs[names.resume(queue)]
        assert defer.partitions == resume.partitions == 5
        assert defer.config["cleanup.policy"] == "compact"
    assert "d.queue.gpu" in specs
    assert "d.queue.gpu.resumes" in specs
    assert len(topic_specs(settings, queues=["fast", "fast", "default"])) == 10


def test_task_events_share_the_tasks_partitions_and_the_resume_retention():
    specs = _by_name(Settings(topic_prefix="d.", partitions=7))
    events, tasks, resume = specs["d.tasks.events"], specs["d.tasks"], specs["d.resume"]
    assert events.partitions == tasks.partitions == 7
    assert events.config == resume.config


def test_specs_do_not_share_config_dicts():
    a, b = topic_specs(Settings())[:2]
    a.config["x"] = "1"
    assert "x" not in b.config
    assert "x" not in topic_specs(Settings())[0].config


def test_bad_queue_name_is_rejected():
    with pytest.raises(InvalidQueueName):
        topic_specs(Settings(), queues=["no spaces"])
