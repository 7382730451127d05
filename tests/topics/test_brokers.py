"""Broker launchers without a broker: the errors that say why one cannot start."""

import socket
import uuid
from pathlib import Path

import pytest
from deferline.topics import BrokerStartError, KRaftBroker, TansuBroker, fetch_kafka_jars, free_port


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


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    # Outgoing connections take their ports from the ephemeral range; a broker's port picked
    # there can be taken between the pick and the broker's bind (seen with parallel tests).
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(10_000 <= port < low for port in ports)
    assert len(ports) > 40, "picks are random, so parallel pickers rarely meet"
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_wildcard_host_advertises_loopback():
    assert TansuBroker(port=1, host="0.0.0.0")._advertised_host() == "127.0.0.1"
    assert TansuBroker(port=1, host="0.0.0.0", advertised_host="me")._advertised_host() == "me"


def test_throwaway_tls_makes_a_ca_and_a_broker_certificate_it_signed(tmp_path: Path) -> None:
    import ssl

    from cryptography import x509
    from deferline.topics import ThrowawayTLS

    tls = ThrowawayTLS.create(tmp_path, "127.0.0.1")
    context = ssl.create_default_context(cafile=str(tls.ca_file))
    context.load_cert_chain(str(tls.keystore_file))  # key and certificate in one PEM
    pem = tls.keystore_file.read_bytes()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8, as Kafka's PEM store wants
    cert = x509.load_pem_x509_certificate(pem[pem.index(b"-----BEGIN CERTIFICATE-----") :])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert cert.subject.rfc4514_string() == "CN=broker"
    other = ThrowawayTLS.create(tmp_path / "other", "127.0.0.1")
    assert other.ca_file.read_bytes() != tls.ca_file.read_bytes()


def test_secured_properties_enforce_acls_and_authenticate_every_listener(tmp_path: Path) -> None:
    from deferline.topics import BrokerSecurity, ThrowawayTLS
    from deferline.topics.testing import scram_arguments, secured_properties

    security = BrokerSecurity(users={"admin": "a", "worker": "w"}, reauth_ms=5000)
    text = secured_properties(
        host="127.0.0.1",
        port=1,
        internal_port=2,
        controller_port=3,
        data=tmp_path,
        tls=ThrowawayTLS.create(tmp_path, "127.0.0.1"),
        security=security,
    )
    assert "listener.security.protocol.map=CLIENT:SASL_SSL,INTERNAL:SSL,CONTROLLER:SSL" in text
    assert "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer" in text
    assert "allow.everyone.if.no.acl.found=false" in text
    assert "super.users=User:admin;User:CN=broker" in text
    assert "listener.name.internal.ssl.client.auth=required" in text
    assert "connections.max.reauth.ms=5000" in text
    assert scram_arguments(security) == [
        "--add-scram",
        "SCRAM-SHA-512=[name=admin,password=a]",
        "--add-scram",
        "SCRAM-SHA-512=[name=worker,password=w]",
    ]
    with pytest.raises(ValueError, match="admin"):
        BrokerSecurity(users={"worker": "w"})


def test_a_cluster_id_never_reads_as_an_option(monkeypatch):
    # One urlsafe-base64 id in 64 starts with "-"; kafka-storage's "-t" would take it for a flag.
    from deferline.topics.testing import new_cluster_id

    dash_first = bytes([0xF8]) + bytes(15)  # encodes to "-A..."
    ids = iter([uuid.UUID(bytes=dash_first), uuid.UUID(int=1)])
    monkeypatch.setattr(uuid, "uuid4", lambda: next(ids))
    cluster_id = new_cluster_id()
    assert not cluster_id.startswith("-")
    assert cluster_id == "AAAAAAAAAAAAAAAAAAAAAQ"


def test_a_request_log_is_configured_only_when_asked_for(tmp_path: Path) -> None:
    from deferline.topics.testing import jvm_command

    lib = tmp_path / "lib"
    plain, logged = tmp_path / "plain", tmp_path / "logged"
    plain.mkdir()
    logged.mkdir()
    jvm_command("java", lib, plain, "256m")
    assert "kafka.request.logger" not in (plain / "log4j2.properties").read_text()
    requests = tmp_path / "requests.log"
    jvm_command("java", lib, logged, "256m", request_log=requests)
    config = (logged / "log4j2.properties").read_text()
    assert "logger.requests.name = kafka.request.logger" in config
    assert "logger.requests.level = DEBUG" in config
    assert f"appender.requests.fileName = {requests}" in config
