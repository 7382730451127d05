"""Trigger kwargs sealed as Fernet tokens: the first key encrypts, every key decrypts.

Secrets ride in trigger kwargs (passwords, tokens), so when keys are configured a
DeferRequest carries its kwargs only as ``kwargs_token``: a Fernet token of the kwargs' tagged
JSON. Listing a new key first and keeping the old ones rotates keys without a stop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from ._codec import dumps_value, loads_value
from ._deferral import DeferFields
from ._errors import DecryptionError, InvalidKwargsKey, SchemaError
from ._models import DeferRequest, WatchRequest

__all__ = ["KwargsCipher", "open_kwargs", "seal"]

_KEY_HELP = (
    "a Fernet key is 32 url-safe base64-encoded bytes; generate one with "
    '`python -c "from deferline.schemas import KwargsCipher; print(KwargsCipher.generate_key())"`'
)


class KwargsCipher:
    """Encrypts and decrypts trigger kwargs with a list of Fernet keys (MultiFernet).

    The first key encrypts; every listed key decrypts. To rotate, put the new key first, keep
    the old ones until no message sealed with them is left (or re-seal them with :meth:`rotate`),
    then drop them. Invalid key material raises :class:`InvalidKwargsKey` here, at construction.
    """

    __slots__ = ("_fernet", "_key_count")

    def __init__(self, keys: Sequence[str | bytes]) -> None:
        if isinstance(keys, str | bytes):
            raise InvalidKwargsKey("pass a list of keys, not a single key")
        if not keys:
            raise InvalidKwargsKey(f"no kwargs key given; {_KEY_HELP}")
        fernets: list[Fernet] = []
        for number, key in enumerate(keys, start=1):
            try:
                fernets.append(Fernet(key.strip()))
            except (ValueError, TypeError) as exc:  # binascii.Error is a ValueError
                raise InvalidKwargsKey(
                    f"kwargs key #{number} of {len(keys)} is not a valid Fernet key; {_KEY_HELP}"
                ) from exc
        self._fernet = MultiFernet(fernets)
        self._key_count = len(fernets)

    @staticmethod
    def generate_key() -> str:
        """A fresh random Fernet key, as text fit for ``DEFERLINE_KWARGS_KEYS``."""
        return Fernet.generate_key().decode("ascii")

    def __repr__(self) -> str:
        return f"KwargsCipher(<{self._key_count} key(s)>)"

    def encrypt(self, kwargs: Mapping[str, Any]) -> str:
        """Seal kwargs: their tagged JSON, encrypted with the first key, as a Fernet token."""
        return self._fernet.encrypt(dumps_value(dict(kwargs))).decode("ascii")

    def _open(self, token: str | bytes) -> bytes:
        if not isinstance(token, str | bytes):
            raise DecryptionError(f"a kwargs token is text, got {type(token).__name__}")
        try:
            return self._fernet.decrypt(token)
        except (InvalidToken, ValueError) as exc:  # ValueError: non-ASCII text
            raise DecryptionError(
                f"no configured kwargs key ({self._key_count} tried) can decrypt this kwargs "
                "token: it was sealed with a key that is not configured, or it is corrupt"
            ) from exc

    def decrypt(self, token: str | bytes) -> dict[str, Any]:
        """Open a token made by :meth:`encrypt` with any configured key."""
        data = self._open(token)
        try:
            kwargs = loads_value(data)
        except SchemaError as exc:
            raise DecryptionError(f"decrypted kwargs are not tagged JSON: {exc}") from exc
        if not isinstance(kwargs, dict):
            raise DecryptionError(
                f"decrypted kwargs are a JSON {type(kwargs).__name__}, not an object"
            )
        return kwargs

    def seal_bytes(self, data: bytes) -> bytes:
        """Seal any bytes (a message between two deferline processes) with the first key."""
        return self._fernet.encrypt(data)

    def open_bytes(self, token: bytes, *, ttl: int | None = None) -> bytes:
        """Open a token made by :meth:`seal_bytes` with any configured key; with ``ttl``, a
        token sealed more than ``ttl`` seconds ago is refused (a replayed message)."""
        try:
            return self._fernet.decrypt(token, ttl=ttl)
        except (InvalidToken, ValueError) as exc:
            raise DecryptionError(
                f"no configured kwargs key ({self._key_count} tried) opens this message"
                + (f", or it was sealed more than {ttl} s ago" if ttl is not None else "")
            ) from exc

    def rotate(self, token: str | bytes) -> str:
        """Re-encrypt a token with the first key (to retire an old key); same plaintext."""
        self._open(token)  # the same clear error as decrypt for a token no key opens
        return self._fernet.rotate(token).decode("ascii")


_Sealable = TypeVar("_Sealable", DeferRequest, WatchRequest)


def seal(request: _Sealable, cipher: KwargsCipher | None) -> _Sealable:
    """Move a request's kwargs into ``kwargs_token``; unchanged without a cipher or if sealed."""
    if cipher is None or request.kwargs_token is not None:
        return request
    return request.model_copy(update={"kwargs": {}, "kwargs_token": cipher.encrypt(request.kwargs)})


def open_kwargs(
    request: DeferRequest | WatchRequest | DeferFields, cipher: KwargsCipher | None
) -> dict[str, Any]:
    """The trigger kwargs of a request: in clear, or decrypted from ``kwargs_token``.

    Raises :class:`DecryptionError` when the token cannot be opened, including when no key is
    configured; the caller dead-letters or fails that one trigger and goes on.
    """
    if request.kwargs_token is None:
        return dict(request.kwargs)
    if cipher is None:
        raise DecryptionError(
            f"trigger {request.trigger_id} carries encrypted kwargs (kwargs_token) but no "
            "kwargs key is configured; set DEFERLINE_KWARGS_KEYS to the key(s) that sealed it"
        )
    try:
        return cipher.decrypt(request.kwargs_token)
    except DecryptionError as exc:
        raise DecryptionError(f"trigger {request.trigger_id}: {exc}") from exc
