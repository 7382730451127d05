"""The `deferline` command line: one entry point for every process and tool."""

from __future__ import annotations

import importlib
from typing import Any

import click

# Each sub-command lives in the module that owns it and is imported only when used,
# so `deferline --help` stays fast and one broken piece cannot break the others.
_COMMANDS: dict[str, tuple[str, str]] = {
    "airflow": ("deferline.runners.airflow_bridge", "airflow_command"),
    "broker": ("deferline.runners._broker_cmd", "broker"),
    "topics": ("deferline.runners._topics_cmd", "topics"),
    "triggerer": ("deferline.runners.triggerer", "triggerer_command"),
    "scheduler": ("deferline.runners.scheduler", "scheduler_command"),
    "worker": ("deferline.runners.worker", "worker_command"),
    "submit": ("deferline.runners._task_cmds", "submit"),
    "tasks": ("deferline.runners._task_cmds", "tasks"),
    "clear": ("deferline.runners._task_cmds", "clear"),
    "console": ("deferline.runners.console", "console_command"),
    "demo": ("deferline.runners.demo", "demo_command"),
    "replay": ("deferline.replay._cli", "replay"),
}

_HELP: dict[str, str] = {
    "airflow": "Airflow: `deferline airflow bridge` stands in for `airflow triggerer`.",
    "broker": "Run the embedded Kafka-compatible broker in the foreground.",
    "topics": "Create or check deferline's topics.",
    "triggerer": "Run a triggerer: a consumer-group member that runs triggers.",
    "scheduler": "Run the scheduler: fold trigger events into task state.",
    "worker": "Run a worker that executes operators and defers them.",
    "submit": "Submit a task.",
    "tasks": "List tasks and their states.",
    "clear": "Clear a task (cancels its trigger if deferred).",
    "console": "Serve a live web page: the loop, groups, stuck deferrals, dead letters.",
    "demo": "Run the end-to-end demo on the embedded broker.",
    "replay": "Read the topics back: timelines, stuck deferrals, re-drive.",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _COMMANDS:
            return None
        module_name, attr = _COMMANDS[cmd_name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            return None
        command: Any = getattr(module, attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module_name}.{attr} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _HELP[name]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deferline")
def main() -> None:
    """deferline: a Kafka-native triggerer for deferrable tasks.

    Workers publish DeferRequests; triggerers (a consumer group) run the triggers and
    emit events; the scheduler folds events into task state and resumes tasks.
    Connection settings come from DEFERLINE_* environment variables or flags.
    """
