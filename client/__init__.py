"""Client API: submit, defer, cancel and read tasks."""

from ._client import Client, ClientError, TaskNotFound, parse_ti_key

__all__ = ["Client", "ClientError", "TaskNotFound", "parse_ti_key"]
