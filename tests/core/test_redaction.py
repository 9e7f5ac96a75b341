"""Every printed exception passes through the secret redaction, not only the Hub's: a secret in an
error line, in the ``--json`` failure object or in a ``-vv`` log line is ``***``, whichever
exception carried it; the secrets are the variables' and files' that hold one, those a command was
given, and those known by their shape."""
from __future__ import annotations

import json
import os
import socket

import pytest

from hybrid_build.core import redaction
from hybrid_build.core.redaction import redact, remember, remember_file
from hybrid_build.pipeline.cli import main

ENV_SECRET = "sk-REDACTenv0123456789abcdef"
FLAG_SECRET = "sk-REDACTflag0123456789abcde"
FILE_SECRET = "hf_REDACTfile0123456789abcdefghijk"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Each test starts with no remembered secret, and leaves none behind."""
    monkeypatch.setattr(redaction, "_secrets", set())
    monkeypatch.setattr(redaction, "_files", set())


@pytest.fixture
def refused_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def test_known_secrets_and_shapes_are_masked(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", ENV_SECRET)
    token = tmp_path / "hf_home" / "token"
    token.parent.mkdir()
    token.write_text(FILE_SECRET + "\n")
    monkeypatch.setenv("HF_HOME", str(token.parent))  # the Hub's token file
    remember(FLAG_SECRET)
    keyfile = tmp_path / "key"
    keyfile.write_text("hbk_REDACTkeyfile0123456789\n")
    remember_file(keyfile)
    text = (f"{ENV_SECRET} {FLAG_SECRET} {FILE_SECRET} hbk_REDACTkeyfile0123456789 "
            "Authorization: Bearer abc.def-123 https://user:pa55word@host/x hf_ABCDEFGHIJKLMNOPQRSTUVWX")
    assert redact(text) == "*** *** *** *** Authorization: Bearer *** https://user:***@host/x ***"
    assert redact("nothing secret here: 1 abc http://host/v1") == "nothing secret here: 1 abc http://host/v1"


def test_a_secret_file_that_is_a_fifo_is_not_opened(tmp_path, monkeypatch):
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(fifo))  # opening it for reading would block
    assert redact("plain") == "plain"


def test_an_exception_that_is_not_the_hubs_is_printed_redacted(refused_url, monkeypatch, capsys):
    """A secret the user put in a URL reaches the error line of an unreachable server (bench's own
    exception), and that line, its --json object and -vv's log lines hold ``***`` in its place."""
    monkeypatch.setenv("OPENAI_API_KEY", ENV_SECRET)
    url = f"{refused_url}?key={ENV_SECRET}&other={FLAG_SECRET}"
    assert main(["bench", url, "--runs", "1", "--json", "--api-key", FLAG_SECRET, "-vv"]) == 3
    out, err = capsys.readouterr()
    assert ENV_SECRET not in out + err and FLAG_SECRET not in out + err
    assert json.loads(out)["error"].startswith(f"no server answers at {refused_url}?key=***&other=***/models")
    assert f"error: no server answers at {refused_url}?key=***&other=***/models" in err
    assert "Traceback" in err  # -vv shows it, redacted too
