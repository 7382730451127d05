"""``deferline broker``: options that do not fit the chosen broker are refused before it starts."""

from pathlib import Path

import pytest
from click.testing import CliRunner
from deferline.runners.testing import broker


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--data-dir", "somewhere"], "--data-dir needs --kafka"),
        (["--kafka", "--advertised-host", "me"], "--advertised-host is for Tansu"),
        (["--kafka", "--host", "0.0.0.0"], "--kafka needs a --host clients can connect to"),
    ],
)
def test_broker_refuses_options_that_do_not_fit(args: list[str], message: str) -> None:
    result = CliRunner().invoke(broker, args)
    assert result.exit_code == 2
    assert message in result.output


def test_broker_refuses_a_data_dir_holding_something_else(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    result = CliRunner().invoke(broker, ["--kafka", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not empty and holds no broker's data" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
