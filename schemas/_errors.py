"""The root of deferline's errors and the schema-level families."""

from __future__ import annotations


class DeferlineError(Exception):
    """Something deferline itself detected went wrong."""


class SchemaError(DeferlineError):
    """A message or value does not match deferline's wire contract.

    ``field`` is the dotted path of the offending value (``"kwargs.moment"``,
    ``"task.try_number"``, ``"xcoms.rows[2]"``), or None when the whole message is at fault;
    ``reason`` is the message without the path.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message


class UnknownSchemaVersion(SchemaError):
    """A message names a schema version this build cannot read."""


class DecryptionError(DeferlineError):
    """Encrypted trigger kwargs could not be decrypted with any configured key."""


class InvalidKwargsKey(DeferlineError, ValueError):
    """A configured kwargs encryption key is not a valid Fernet key."""
