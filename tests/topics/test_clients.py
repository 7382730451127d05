"""Client factories: what each aiokafka client gets from Settings (no broker needed)."""

import asyncio
import datetime as dt
import ssl
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from deferline.topics import (
    BrokerError,
    Murmur2Partitioner,
    Settings,
    known_position,
    make_admin,
    make_consumer,
    make_producer,
)
from deferline.topics.testing import connection_kwargs


@pytest.fixture
async def closing():
    """Collects clients made in a test and closes them (unstarted clients warn otherwise)."""
    made: list[Any] = []
    yield made.append
    for client in made:
        await (client.close() if hasattr(client, "close") else client.stop())


@pytest.fixture
def tls_files(tmp_path):
    """A self-signed CA certificate and a client cert/key pair, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "deferline-test")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    (tmp_path / "ca.pem").write_bytes(cert_pem)
    (tmp_path / "client.pem").write_bytes(cert_pem)
    (tmp_path / "client.key").write_bytes(key_pem)
    return {
        "ssl_cafile": str(tmp_path / "ca.pem"),
        "ssl_certfile": str(tmp_path / "client.pem"),
        "ssl_keyfile": str(tmp_path / "client.key"),
    }


def test_plaintext_kwargs():
    kwargs = connection_kwargs(Settings(bootstrap_servers="b1:9092,b2:9092", client_id="me"))
    assert kwargs == {
        "bootstrap_servers": "b1:9092,b2:9092",
        "client_id": "me",
        "security_protocol": "PLAINTEXT",
    }


def test_ssl_builds_a_verifying_context_from_the_files(tls_files):
    kwargs = connection_kwargs(Settings(security_protocol="SSL", **tls_files))
    context = kwargs["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    assert any(
        c["subject"] == ((("commonName", "deferline-test"),),) for c in context.get_ca_certs()
    )
    assert "sasl_mechanism" not in kwargs


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_ssl_wires_mechanism_credentials_and_tls(mechanism, tls_files):
    settings = Settings(
        security_protocol="SASL_SSL",
        sasl_mechanism=mechanism,
        sasl_username="alice",
        sasl_password="s3cret",
        ssl_cafile=tls_files["ssl_cafile"],
    )
    kwargs = connection_kwargs(settings)
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert kwargs["sasl_mechanism"] == mechanism
    assert (kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == ("alice", "s3cret")
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)


def test_sasl_plaintext_has_no_tls():
    settings = Settings(
        security_protocol="SASL_PLAINTEXT", sasl_username="alice", sasl_password="pw"
    )
    kwargs = connection_kwargs(settings)
    assert "ssl_context" not in kwargs
    assert kwargs["sasl_mechanism"] == "PLAIN"


def test_missing_tls_file_is_a_clear_error(tmp_path):
    settings = Settings(security_protocol="SSL", ssl_cafile=str(tmp_path / "nope.pem"))
    with pytest.raises(BrokerError, match="cannot load TLS files"):
        connection_kwargs(settings)


class _Captured:
    """Stands in for an aiokafka client class and records the arguments it was given."""

    calls: list[Any] = []

    def __init__(self, *args, **kwargs):
        _Captured.calls.append((args, kwargs))


@pytest.fixture
def captured(monkeypatch):
    _Captured.calls = []
    for name in ("AIOKafkaProducer", "AIOKafkaConsumer", "AIOKafkaAdminClient"):
        monkeypatch.setattr(f"deferline.topics._clients.{name}", _Captured)
    return _Captured.calls


def test_producer_uses_murmur2_and_low_latency_defaults(captured):
    make_producer(Settings(client_id="p1"))
    make_producer(Settings(), linger_ms=50, acks=1)
    (_, first), (_, second) = captured
    assert isinstance(first["partitioner"], Murmur2Partitioner)
    assert first["client_id"] == "p1"
    assert first["acks"] == "all"
    assert first["linger_ms"] <= 5
    assert "enable_idempotence" not in first  # Tansu lacks it; opt in on Apache Kafka
    assert (second["linger_ms"], second["acks"]) == (50, 1)


def test_consumer_defaults_and_overrides(captured):
    make_consumer(Settings(), "t1", "t2", group_id="g")
    make_consumer(Settings(), enable_auto_commit=True, fetch_max_wait_ms=5)
    (topics, first), (_, second) = captured
    assert topics == ("t1", "t2")
    assert first["group_id"] == "g"
    assert first["fetch_max_wait_ms"] <= 50  # Tansu holds every fetch this long
    assert first["enable_auto_commit"] is False
    assert first["auto_offset_reset"] == "earliest"
    assert second["group_id"] is None
    assert (second["enable_auto_commit"], second["fetch_max_wait_ms"]) == (True, 5)


def test_admin_gets_the_connection(captured, tls_files):
    make_admin(Settings(security_protocol="SSL", **tls_files), request_timeout_ms=1000)
    ((_, kwargs),) = captured
    assert kwargs["security_protocol"] == "SSL"
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
    assert kwargs["request_timeout_ms"] == 1000


async def test_clients_accept_sasl_ssl_settings(tls_files, closing):
    settings = Settings(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="alice",
        sasl_password="pw",
        **tls_files,
    )
    producer, consumer, admin = (
        make_producer(settings),
        make_consumer(settings, "t"),
        make_admin(settings),
    )
    for made in (producer, consumer, admin):
        closing(made)
    for client in (producer.client, consumer._client, admin._client):
        assert client._security_protocol == "SASL_SSL"
        assert client._sasl_mechanism == "SCRAM-SHA-512"
        assert client._sasl_plain_username == "alice"
        assert isinstance(client._ssl_context, ssl.SSLContext)


class _Positions:
    """Stands for a consumer's ``position``: known, not assigned, or being looked up."""

    def __init__(self, answer: int | BaseException | None) -> None:
        self.answer = answer

    async def position(self, tp: Any) -> int:
        if self.answer is None:
            await asyncio.Event().wait()  # an offset lookup that does not come back
        if isinstance(self.answer, BaseException):
            raise self.answer
        assert isinstance(self.answer, int)
        return self.answer


async def test_known_position_answers_at_once_or_says_none():
    tp = TopicPartition("t", 0)
    assert await known_position(_Positions(42), tp) == 42
    unassigned = _Positions(IllegalStateError("Partition t-0 is not assigned"))
    assert await known_position(unassigned, tp) is None
    lookup = _Positions(None)  # a lookup that never comes back is not waited for
    assert await known_position(lookup, tp, within=0.05) is None
