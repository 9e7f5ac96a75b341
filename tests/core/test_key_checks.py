"""The shared checks on the served API's key: a 401/403 said in one line, and a secret being one word."""
from __future__ import annotations

import io
import urllib.error

import pytest

from hybrid_build.core.api_key import HINT, raise_if_refused
from hybrid_build.core.errors import KeyRefused
from hybrid_build.core.private_file import is_one_word


def _http_error(code: int) -> urllib.error.HTTPError:
    return urllib.error.HTTPError("http://h/v1/models", code, "x", {}, io.BytesIO(b""))


@pytest.mark.parametrize("code", [401, 403])
def test_a_refusal_is_key_refused_without_the_http_error(code):
    try:
        raise _http_error(code)
    except urllib.error.HTTPError as e:
        with pytest.raises(KeyRefused) as got:
            raise_if_refused(e, "http://h/v1", sent=False)
    assert str(got.value) == f"the server at http://h/v1 wants an API key and none was sent (HTTP {code}): {HINT}"
    assert got.value.__suppress_context__ and got.value.__cause__ is None


def test_a_refusal_says_whether_a_key_was_sent_and_the_callers_hint():
    with pytest.raises(KeyRefused, match=r"refused the API key \(HTTP 401\): do this$"):
        raise_if_refused(_http_error(401), "http://h/v1", sent=True, hint="do this")


@pytest.mark.parametrize("code", [400, 404, 500])
def test_other_codes_are_left_to_the_caller(code):
    assert raise_if_refused(_http_error(code), "http://h/v1", sent=True) is None


@pytest.mark.parametrize("secret, ok", [("hbk_abc", True), ("a-b.c/~!", True), ("", False), (" ", False),
                                        ("two words", False), ("tab\tin", False), ("line\n", False),
                                        ("nbsp\u00a0in", False)])
def test_a_secret_is_one_word(secret, ok):
    assert is_one_word(secret) is ok
