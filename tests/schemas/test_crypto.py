"""Kwargs encryption: sealed on the wire, rotation, and clear errors instead of crashes."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from cryptography.fernet import Fernet
from deferline.schemas import (
    DecryptionError,
    DeferlineError,
    DeferRequest,
    InvalidKwargsKey,
    KwargsCipher,
    SchemaError,
    decode_as,
    encode,
    open_kwargs,
    seal,
)
from hypothesis import given, settings

from ._examples import KWARGS, TASK
from ._values import kwargs_dicts, same

OLD = KwargsCipher.generate_key()
NEW = KwargsCipher.generate_key()
SECRET = {"password": "hunter2", "at": dt.datetime(2030, 1, 1, tzinfo=dt.UTC)}


def request(kwargs: dict[str, Any] | None = None) -> DeferRequest:
    return DeferRequest(
        trigger_id="t-1", task=TASK, classpath="a.B", kwargs=SECRET if kwargs is None else kwargs
    )


def test_round_trip_keeps_tagged_types() -> None:
    cipher = KwargsCipher([NEW])
    token = cipher.encrypt(KWARGS)
    assert isinstance(token, str)
    assert same(cipher.decrypt(token), KWARGS)


@settings(max_examples=30, deadline=None)
@given(kwargs_dicts)
def test_any_kwargs_round_trip(kwargs: dict[str, Any]) -> None:
    cipher = KwargsCipher([NEW])
    assert same(cipher.decrypt(cipher.encrypt(kwargs)), kwargs)


def test_rotation_first_key_encrypts_every_key_decrypts() -> None:
    old_token = KwargsCipher([OLD]).encrypt(SECRET)
    rotated = KwargsCipher([NEW, OLD])
    assert rotated.decrypt(old_token) == SECRET  # the old key still decrypts
    new_token = rotated.encrypt(SECRET)
    assert KwargsCipher([NEW]).decrypt(new_token) == SECRET  # the first key encrypted
    with pytest.raises(DecryptionError):
        KwargsCipher([OLD]).decrypt(new_token)


def test_rotate_reseals_with_the_first_key() -> None:
    old_token = KwargsCipher([OLD]).encrypt(SECRET)
    resealed = KwargsCipher([NEW, OLD]).rotate(old_token)
    assert KwargsCipher([NEW]).decrypt(resealed) == SECRET
    with pytest.raises(DecryptionError, match="no configured kwargs key"):
        KwargsCipher([NEW]).rotate(old_token)


def test_wrong_key_is_a_clear_decryption_error() -> None:
    token = KwargsCipher([OLD]).encrypt(SECRET)
    with pytest.raises(DecryptionError, match=r"no configured kwargs key \(1 tried\) can decrypt"):
        KwargsCipher([NEW]).decrypt(token)


@pytest.mark.parametrize("token", ["", "garbage", "gAAAAA" + "x" * 80, "été", b"\x00\x01"])
def test_garbage_tokens_are_decryption_errors(token: str | bytes) -> None:
    with pytest.raises(DecryptionError):
        KwargsCipher([NEW]).decrypt(token)


def test_a_non_text_token_is_a_decryption_error() -> None:
    with pytest.raises(DecryptionError, match="is text, got int"):
        KwargsCipher([NEW]).decrypt(5)  # type: ignore[arg-type]


def test_decrypted_plaintext_that_is_not_a_kwargs_object_is_a_decryption_error() -> None:
    cipher = KwargsCipher([NEW])
    with pytest.raises(DecryptionError, match="not an object"):
        cipher.decrypt(Fernet(NEW).encrypt(b"[1, 2]").decode())
    with pytest.raises(DecryptionError, match="not tagged JSON"):
        cipher.decrypt(Fernet(NEW).encrypt(b"{oops").decode())


@pytest.mark.parametrize(
    "keys",
    [[], ["short"], [NEW, "not base64 at all!"], [Fernet.generate_key()[:-4]]],
)
def test_invalid_key_material_fails_at_construction(keys: list[str | bytes]) -> None:
    with pytest.raises(InvalidKwargsKey) as info:
        KwargsCipher(keys)
    assert NEW not in str(info.value)  # never echo key material
    assert isinstance(info.value, DeferlineError)


def test_a_single_key_instead_of_a_list_is_refused() -> None:
    with pytest.raises(InvalidKwargsKey, match="list of keys"):
        KwargsCipher(NEW)


def test_keys_may_be_bytes_and_carry_whitespace() -> None:
    token = KwargsCipher([NEW.encode()]).encrypt(SECRET)
    assert KwargsCipher([f" {NEW}\n"]).decrypt(token) == SECRET


def test_repr_hides_keys() -> None:
    assert NEW not in repr(KwargsCipher([NEW, OLD]))
    assert "2 key" in repr(KwargsCipher([NEW, OLD]))


def test_unencodable_kwargs_name_the_field() -> None:
    with pytest.raises(SchemaError) as info:
        KwargsCipher([NEW]).encrypt({"at": dt.datetime(2030, 1, 1)})
    assert info.value.field == "at"


def test_seal_moves_kwargs_into_the_token_and_open_kwargs_gets_them_back() -> None:
    cipher = KwargsCipher([NEW])
    sealed = seal(request(), cipher)
    assert sealed.kwargs == {}
    assert sealed.kwargs_token is not None
    data = encode(sealed)
    assert b"hunter2" not in data
    back = decode_as(data, DeferRequest)
    assert open_kwargs(back, cipher) == SECRET
    assert open_kwargs(back, KwargsCipher([OLD, NEW])) == SECRET


def test_seal_without_cipher_is_a_no_op_and_sealing_twice_changes_nothing() -> None:
    plain = request()
    assert seal(plain, None) is plain
    cipher = KwargsCipher([NEW])
    sealed = seal(plain, cipher)
    assert seal(sealed, cipher) is sealed


def test_open_kwargs_of_a_plain_request_needs_no_cipher() -> None:
    assert open_kwargs(request(), None) == SECRET
    assert open_kwargs(request(), KwargsCipher([NEW])) == SECRET
    opened = open_kwargs(request(), None)
    opened["x"] = 1
    assert "x" not in request().kwargs


def test_a_token_without_a_configured_key_says_so() -> None:
    sealed = seal(request(), KwargsCipher([NEW]))
    with pytest.raises(DecryptionError, match="no kwargs key is configured") as info:
        open_kwargs(sealed, None)
    assert "t-1" in str(info.value)


def test_open_kwargs_with_the_wrong_key_names_the_trigger() -> None:
    sealed = seal(request(), KwargsCipher([OLD]))
    with pytest.raises(DecryptionError, match="trigger t-1: no configured kwargs key"):
        open_kwargs(sealed, KwargsCipher([NEW]))


def test_an_empty_kwargs_dict_is_sealed_too() -> None:
    cipher = KwargsCipher([NEW])
    sealed = seal(request({}), cipher)
    assert sealed.kwargs_token is not None
    assert open_kwargs(sealed, cipher) == {}
