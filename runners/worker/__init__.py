"""The worker process: runs operators, defers them, and resumes them."""

from ._cli import worker_command
from ._errors import WorkerError
from ._runner import RecordSink, TaskRunner
from ._worker import Worker

__all__ = [
    "RecordSink",
    "TaskRunner",
    "Worker",
    "WorkerError",
    "worker_command",
]
