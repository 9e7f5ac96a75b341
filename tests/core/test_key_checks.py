"""The shared checks on the served API's key: a 401/403 said in one line, and a secret being one word."""
from __future__ import annotations

import pytest

from hybrid_build.core.api_key import HINT, refused
from hybrid_build.core.errors import KeyRefused
from hybrid_build.core.private_file import is_one_word


@pytest.mark.parametrize("code", [401, 403])
def test_a_refusal_says_no_key_was_sent(code):
    got = refused("http://h/v1", code, sent=False)
    assert isinstance(got, KeyRefused)
    assert str(got) == f"the server at http://h/v1 wants an API key and none was sent (HTTP {code}): {HINT}"


def test_a_refusal_says_whether_a_key_was_sent_and_the_callers_hint():
    assert str(refused("http://h/v1", 401, sent=True, hint="do this")) == \
        "the server at http://h/v1 refused the API key (HTTP 401): do this"


@pytest.mark.parametrize("secret, ok", [("hbk_abc", True), ("a-b.c/~!", True), ("", False), (" ", False),
                                        ("two words", False), ("tab\tin", False), ("line\n", False),
                                        ("nbsp\u00a0in", False)])
def test_a_secret_is_one_word(secret, ok):
    assert is_one_word(secret) is ok
