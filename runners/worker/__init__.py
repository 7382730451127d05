"""The worker process: runs operators, defers them, and resumes them."""

from ._worker import (
    RecordSink,
    TaskRunner,
    Worker,
    WorkerError,
    worker_command,
)

__all__ = [
    "RecordSink",
    "TaskRunner",
    "Worker",
    "WorkerError",
    "worker_command",
]
