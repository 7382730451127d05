"""connection_options: flags build a Settings and override the environment."""

import click
import pytest
from click.testing import CliRunner
from deferline.runners.testing import connection_options, layout_options
from deferline.topics import Settings


@click.command()
@layout_options
@connection_options
def show(settings: Settings) -> None:
    click.echo(
        f"{settings.bootstrap_servers} {settings.client_id} {settings.topic_prefix} "
        f"{settings.partitions} {settings.security_protocol}"
    )


@pytest.fixture
def runner(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("DEFERLINE_"):
            monkeypatch.delenv(name)
    return CliRunner()


def test_defaults_come_from_settings(runner):
    result = runner.invoke(show, [])
    assert result.exit_code == 0, result.output
    assert result.output.split() == ["localhost:9092", "deferline", "deferline.", "12", "PLAINTEXT"]


def test_environment_applies_and_flags_win(runner):
    env = {"DEFERLINE_BOOTSTRAP_SERVERS": "env:1", "DEFERLINE_CLIENT_ID": "env-id"}
    result = runner.invoke(
        show,
        ["--bootstrap-servers", "flag:2", "--partitions", "3", "--topic-prefix", "x."],
        env=env,
    )
    assert result.exit_code == 0, result.output
    assert result.output.split() == ["flag:2", "env-id", "x.", "3", "PLAINTEXT"]


def test_invalid_combination_is_a_usage_error(runner):
    result = runner.invoke(show, ["--security-protocol", "SASL_SSL"])
    assert result.exit_code == 2
    assert "sasl_username" in result.output


def test_missing_tls_file_is_rejected_by_click(runner, tmp_path):
    result = runner.invoke(show, ["--ssl-cafile", str(tmp_path / "nope.pem")])
    assert result.exit_code == 2
    assert "does not exist" in result.output
