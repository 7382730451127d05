"""Broker launchers without a broker: the errors that say why one cannot start."""

import pytest
from deferline.topics import BrokerStartError, KRaftBroker, TansuBroker, fetch_kafka_jars
from deferline.topics._brokers import free_port


async def test_kraft_without_java_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    broker = KRaftBroker(tmp_path / "cache")
    with pytest.raises(BrokerStartError, match="java is not on PATH"):
        await broker.start()
    with pytest.raises(BrokerStartError, match="not running"):
        _ = broker.bootstrap


def test_fetch_without_maven_or_cache_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BrokerStartError, match="mvn is not on PATH") as info:
        fetch_kafka_jars(tmp_path / "cache", version="4.1.1")
    assert str(tmp_path / "cache" / "kafka-4.1.1" / "lib") in str(info.value)


def test_cached_jars_need_no_maven(monkeypatch, tmp_path):
    lib = tmp_path / "kafka-9.9.9" / "lib"
    lib.mkdir(parents=True)
    (lib / ".complete").write_text("")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert fetch_kafka_jars(tmp_path, version="9.9.9") == lib


def test_failed_maven_build_reports_its_output(monkeypatch, tmp_path):
    fake_mvn = tmp_path / "bin" / "mvn"
    fake_mvn.parent.mkdir()
    fake_mvn.write_text(
        "#!/bin/sh\necho 'Could not resolve org.apache.kafka:kafka_2.13:0.0.0'\nexit 1\n"
    )
    fake_mvn.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake_mvn.parent))
    with pytest.raises(BrokerStartError, match=r"Maven failed \(exit 1") as info:
        fetch_kafka_jars(tmp_path / "cache", version="0.0.0")
    assert "Could not resolve" in str(info.value)
    assert not (tmp_path / "cache" / "kafka-0.0.0" / "lib").exists()


def test_tansu_bootstrap_only_while_running():
    broker = TansuBroker(port=free_port())
    with pytest.raises(BrokerStartError, match="not running"):
        _ = broker.bootstrap


def test_wildcard_host_advertises_loopback():
    assert TansuBroker(port=1, host="0.0.0.0")._advertised_host() == "127.0.0.1"
    assert TansuBroker(port=1, host="0.0.0.0", advertised_host="me")._advertised_host() == "me"
