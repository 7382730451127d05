"""The root of deferline's errors and the schema-level families."""

from __future__ import annotations


class DeferlineError(Exception):
    """Something deferline itself detected went wrong."""


class SchemaError(DeferlineError):
    """A message or value does not match deferline's wire contract."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class UnknownSchemaVersion(SchemaError):
    """A message names a schema version this build cannot read."""


class DecryptionError(DeferlineError):
    """Encrypted trigger kwargs could not be decrypted with any configured key."""
