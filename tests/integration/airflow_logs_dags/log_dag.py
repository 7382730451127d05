"""A task that defers on a trigger that logs, for the trigger-logs test."""

# mypy: ignore-errors
from __future__ import annotations

import os
from typing import Any

from airflow.sdk import DAG, BaseOperator
from log_triggers import ChattyTrigger


class ChattyOperator(BaseOperator):
    def execute(self, context: Any) -> None:
        release = os.path.join(os.environ["LOGS_RELEASE_DIR"], context["run_id"])
        self.defer(trigger=ChattyTrigger(release=release, name=self.task_id), method_name="done")

    def done(self, context: Any, event: Any = None) -> int:
        self.log.info("resumed after %s trigger lines", event["lines"])
        return int(event["lines"])


with DAG(dag_id="logging_trigger", schedule=None, catchup=False):
    ChattyOperator(task_id="chatty")
