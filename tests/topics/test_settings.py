import pydantic
import pytest
from deferline.topics import Settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("DEFERLINE_"):
            monkeypatch.delenv(name)


def test_defaults():
    s = Settings()
    assert s.bootstrap_servers == "localhost:9092"
    assert s.client_id == "deferline"
    assert s.security_protocol == "PLAINTEXT"
    assert s.topic_prefix == "deferline."
    assert (s.partitions, s.replication_factor) == (12, 1)
    assert s.kwargs_keys == []
    assert s.allowed_trigger_prefixes == ["deferline.engine.triggers"]


def test_environment_with_prefix_and_comma_separated_lists(monkeypatch):
    monkeypatch.setenv("DEFERLINE_BOOTSTRAP_SERVERS", "k1:9092,k2:9092")
    monkeypatch.setenv("DEFERLINE_PARTITIONS", "24")
    monkeypatch.setenv("DEFERLINE_KWARGS_KEYS", "new-key, old-key")
    monkeypatch.setenv(
        "DEFERLINE_ALLOWED_TRIGGER_PREFIXES", "deferline.engine.triggers,acme.triggers"
    )
    s = Settings()
    assert s.bootstrap_servers == "k1:9092,k2:9092"
    assert s.partitions == 24
    assert s.kwargs_keys == ["new-key", "old-key"]
    assert s.allowed_trigger_prefixes == ["deferline.engine.triggers", "acme.triggers"]


def test_json_lists_and_single_values_from_env(monkeypatch):
    monkeypatch.setenv("DEFERLINE_KWARGS_KEYS", '["k1", "k2"]')
    monkeypatch.setenv("DEFERLINE_ALLOWED_TRIGGER_PREFIXES", "only.this")
    s = Settings()
    assert s.kwargs_keys == ["k1", "k2"]
    assert s.allowed_trigger_prefixes == ["only.this"]


def test_keyword_arguments_override_environment(monkeypatch):
    monkeypatch.setenv("DEFERLINE_CLIENT_ID", "from-env")
    assert Settings(client_id="from-arg").client_id == "from-arg"
    assert Settings().client_id == "from-env"


def test_unrelated_deferline_env_vars_are_ignored(monkeypatch):
    monkeypatch.setenv("DEFERLINE_TEST_BOOTSTRAP", "x:1")
    assert Settings().bootstrap_servers == "localhost:9092"


def test_frozen_and_unknown_fields_rejected():
    s = Settings()
    with pytest.raises(pydantic.ValidationError):
        s.partitions = 3  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="extra"):
        Settings(partitons=3)  # type: ignore[call-arg]


def test_secrets_stay_out_of_repr():
    s = Settings(
        security_protocol="SASL_SSL",
        sasl_username="u",
        sasl_password="hunter2",
        kwargs_keys=["fernet-secret"],
    )
    assert "hunter2" not in repr(s)
    assert "fernet-secret" not in repr(s)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"security_protocol": "SASL_PLAINTEXT"}, "sasl_username"),
        ({"security_protocol": "TLS"}, "security_protocol"),
        ({"sasl_mechanism": "GSSAPI"}, "sasl_mechanism"),
        ({"partitions": 0}, "partitions"),
        ({"topic_prefix": "bad prefix/"}, "topic prefix"),
    ],
)
def test_invalid_settings_name_the_problem(kwargs, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        Settings(**kwargs)
