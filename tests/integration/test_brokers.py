"""Broker launchers: they start, answer, stop, and never outlive the process that started them."""

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from deferline.topics import BrokerStartError, KRaftBroker, Settings, TansuBroker, describe_topics
from deferline.topics.testing import free_port, metadata_has_broker

from tests._until import until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


async def test_tansu_starts_answers_and_cleans_up():
    async with TansuBroker() as tansu:
        host, port = tansu.bootstrap.split(":")
        assert await metadata_has_broker(host, int(port))
        pid = tansu._proc.pid  # type: ignore[union-attr]
        workdir = tansu.log_path.parent  # type: ignore[union-attr]
        assert await describe_topics(Settings(bootstrap_servers=tansu.bootstrap)) == []
    assert not _alive(pid)
    assert not workdir.exists()
    await tansu.stop()  # idempotent


async def test_tansu_on_a_busy_port_says_why():
    async with TansuBroker() as first:
        port = int(first.bootstrap.split(":")[1])
        second = TansuBroker(port=port, startup_timeout=5)
        # Tansu binds with SO_REUSEPORT, so it would share the port silently; we refuse.
        with pytest.raises(BrokerStartError, match=f"port {port} on 127.0.0.1 is in use"):
            await second.start()
        assert second._proc is None


async def test_kraft_starts_and_cleans_up():
    from tests.conftest import selected_backends, unavailable

    if "kafka" not in selected_backends():
        pytest.skip("the kafka backend is not selected")
    kraft = KRaftBroker()
    try:
        await kraft.start()
    except BrokerStartError as exc:
        await kraft.stop()
        unavailable("kafka", str(exc))
    pid, workdir = kraft._proc.pid, kraft.log_path.parent  # type: ignore[union-attr]
    try:
        host, port = kraft.bootstrap.split(":")
        assert await metadata_has_broker(host, int(port))
    finally:
        await kraft.stop()
    assert not _alive(pid)
    assert not workdir.exists()


async def _spawn(script: str) -> tuple[asyncio.subprocess.Process, int, Path]:
    """Run a Python script that starts Tansu; return it, the broker's pid and work dir."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    pid, workdir = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).split()
    return proc, int(pid), Path(workdir.decode())


_START = textwrap.dedent(
    """
    import asyncio, sys
    from deferline.topics import TansuBroker
    from deferline.topics._process import _LIVE
    asyncio.run(TansuBroker().start())
    pid, (_, workdir) = next(iter(_LIVE.items()))
    print(pid, workdir, flush=True)
    """
)


async def test_broker_dies_with_a_killed_parent():
    proc, broker_pid, workdir = await _spawn(_START + "import time; time.sleep(120)\n")
    assert _alive(broker_pid)
    proc.kill()
    await proc.wait()
    await until(lambda: not _alive(broker_pid), within=10, interval=0.05, what="broker gone")
    shutil.rmtree(workdir)  # nobody was left to remove it


async def test_broker_is_stopped_at_interpreter_exit():
    proc, broker_pid, workdir = await _spawn(_START)  # exits without stopping the broker
    assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    await until(lambda: not _alive(broker_pid), within=10, interval=0.05, what="broker gone")
    assert not workdir.exists()


async def test_sigterm_to_pytest_stops_the_session_brokers(tmp_path):
    (tmp_path / "test_wait.py").write_text(
        textwrap.dedent(
            """
            import time
            import pytest
            from deferline.topics._process import _LIVE

            @pytest.mark.integration
            def test_wait(broker):
                print("BROKER", *_LIVE, flush=True)
                time.sleep(60)
            """
        )
    )
    env = {**os.environ, "DEFERLINE_TEST_BACKENDS": "tansu"}
    env.pop("DEFERLINE_TEST_BOOTSTRAP", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider",
        "-p", "tests.conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_wait.py"),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    line = b""
    while not line.startswith(b"BROKER"):
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        assert line, "pytest ended before its broker started"
    broker_pids = [int(p) for p in line.split()[1:]]
    assert broker_pids
    assert all(_alive(p) for p in broker_pids)
    proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(proc.wait(), timeout=30)
    await until(
        lambda: not any(_alive(p) for p in broker_pids),
        within=10,
        interval=0.05,
        what="brokers gone",
    )


async def test_deferline_broker_command_prints_bootstrap_and_stops_on_sigterm():
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "deferline"), "broker", "--port", str(port),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert f"bootstrap: 127.0.0.1:{port}" in first.decode(), first
        assert await metadata_has_broker("127.0.0.1", port)
        children = _children(proc.pid)
        assert children, "the Tansu process should be a child of the command"
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, rest.decode()
    for child in children:
        assert not _alive(child)


def _kafka_selected() -> None:
    from tests.conftest import selected_backends

    if "kafka" not in selected_backends():
        pytest.skip("the kafka backend is not selected")


async def _broker_command(*args: str, tmpdir: Path) -> tuple[asyncio.subprocess.Process, str]:
    """Start ``deferline broker --kafka ARGS`` (temp dirs in ``tmpdir``); wait for its address."""
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "deferline"), "broker", "--kafka", *args,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmpdir)},
    )  # fmt: skip
    assert proc.stdout is not None
    output = b""
    while b"bootstrap: " not in output:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=180)
        if not line:
            await proc.wait()
            from tests.conftest import unavailable

            unavailable("kafka", output.decode(errors="replace"))
        output += line
    bootstrap = output.decode().split("bootstrap: ")[1].split()[0]
    return proc, bootstrap


def _java_children(pid: int) -> list[int]:
    return [
        child
        for child in _children(pid)
        if b"kafka.Kafka" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


async def _stop_command(proc: asyncio.subprocess.Process, sig: signal.Signals) -> str:
    proc.send_signal(sig)
    rest, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, rest.decode()
    return rest.decode()


async def test_broker_command_kafka_serves_topics_and_stops_on_sigint(tmp_path):
    _kafka_selected()
    port = free_port()
    proc, bootstrap = await _broker_command("--port", str(port), tmpdir=tmp_path)
    try:
        assert bootstrap == f"127.0.0.1:{port}"
        java = _java_children(proc.pid)
        assert len(java) == 1, "Apache Kafka should run as one java child of the command"
        (workdir,) = tmp_path.glob("deferline-kafka-*")
        settings = Settings(bootstrap_servers=bootstrap, topic_prefix="cmd.", partitions=3)
        from deferline.topics import ensure_topics, topic_specs

        await ensure_topics(settings, topic_specs(settings))
        (described,) = await describe_topics(settings, ["cmd.tasks"])
        assert described.partitions == 3
    finally:
        rest = await _stop_command(proc, signal.SIGINT)
    assert "stopped" in rest
    assert not _alive(java[0])
    assert not workdir.exists()


async def test_broker_command_kafka_keeps_data_in_data_dir(tmp_path):
    _kafka_selected()
    data = tmp_path / "kafka-data"
    from deferline.topics import ensure_topics, topic_specs

    proc, bootstrap = await _broker_command("--port", str(free_port()), "--data-dir", str(data),
                                            tmpdir=tmp_path)  # fmt: skip
    try:
        settings = Settings(bootstrap_servers=bootstrap, topic_prefix="kept.", partitions=2)
        await ensure_topics(settings, topic_specs(settings))
    finally:
        await _stop_command(proc, signal.SIGTERM)
    assert (data / "data" / "meta.properties").exists()

    proc, bootstrap = await _broker_command("--port", str(free_port()), "--data-dir", str(data),
                                            tmpdir=tmp_path)  # fmt: skip
    try:
        settings = Settings(bootstrap_servers=bootstrap, topic_prefix="kept.", partitions=2)
        (described,) = await describe_topics(settings, ["kept.tasks"])
        assert described.partitions == 2
    finally:
        await _stop_command(proc, signal.SIGTERM)
    assert data.exists()
