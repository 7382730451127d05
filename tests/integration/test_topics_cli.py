"""`deferline topics ensure` and `deferline topics list` against a real broker."""

import asyncio

import pytest
from aiokafka.admin import NewTopic
from click.testing import CliRunner
from deferline.runners.cli import main
from deferline.topics import make_admin

pytestmark = pytest.mark.integration


@pytest.mark.tansu_first
def test_topics_ensure_then_list(settings):
    runner = CliRunner()
    flags = [
        "--bootstrap-servers",
        settings.bootstrap_servers,
        "--topic-prefix",
        settings.topic_prefix,
    ]
    prefix = settings.topic_prefix

    result = runner.invoke(
        main,
        [
            "topics",
            "ensure",
            *flags,
            "--partitions",
            "3",
            "--queue",
            "fast",
            "--worker-queue",
            "gpu",
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"{prefix}defer.fast" in result.output
    assert f"{prefix}queue.gpu.resumes" in result.output

    result = runner.invoke(main, ["topics", "list", *flags])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split()[1:] for line in result.output.splitlines()[1:]}
    assert set(rows) == {
        f"{prefix}{name}"
        for name in (
            "defer", "resume", "defer.fast", "resume.fast", "tasks", "queue", "queue.resumes",
            "queue.gpu", "queue.gpu.resumes", "dead", "tasks.events", "scheduler.pools",
        )
    }  # fmt: skip
    assert rows.pop(f"{prefix}scheduler.pools")[0] == "1", "the pool ledger: one partition"
    assert all(cols[0] == "3" for cols in rows.values())
    assert "cleanup.policy=compact" in rows[f"{prefix}defer"]


@pytest.mark.tansu_first
def test_topics_ensure_reports_a_broken_layout(settings):
    async def break_the_pair() -> None:
        admin = make_admin(settings)
        await admin.start()
        try:
            await admin.create_topics(
                [NewTopic(f"{settings.topic_prefix}defer", 2, 1),
                 NewTopic(f"{settings.topic_prefix}resume", 3, 1)]
            )  # fmt: skip
        finally:
            await admin.close()

    asyncio.run(break_the_pair())
    flags = [
        "--bootstrap-servers",
        settings.bootstrap_servers,
        "--topic-prefix",
        settings.topic_prefix,
    ]
    result = CliRunner().invoke(main, ["topics", "ensure", *flags])
    assert result.exit_code == 1
    assert "not co-partitioned" in result.output
    assert f"{settings.topic_prefix}defer has 2 partitions" in result.output


def test_unreachable_cluster_is_a_clear_error():
    result = CliRunner().invoke(
        main, ["topics", "list", "--bootstrap-servers", "127.0.0.1:1", "--client-id", "x"]
    )
    assert result.exit_code == 1
    assert "cannot reach Kafka at 127.0.0.1:1" in result.output
