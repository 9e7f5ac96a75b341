"""One state folder: this machine's trust records (``core.local_trust``) live in the user's state
folder (``core.state_dir``) beside serve's logs and keys, unless ``HYBRID_BUILD_TRUST_DIR`` names
another; and a record there is read back bounded (a FIFO in its place is no record, never waited on)."""
from __future__ import annotations

import hashlib
import os

from hybrid_build.core import local_trust
from hybrid_build.core.state_dir import ENV as STATE_ENV

BUILD = hashlib.sha256(b"a build").hexdigest()


def test_trust_records_follow_the_state_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(local_trust.TRUST_ENV, raising=False)
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "state"))
    path = local_trust.remember(BUILD, local_trust.BUILT, tmp_path)
    assert path.parent.parent == tmp_path / "state" / "trust"
    assert local_trust.recalled(BUILD, local_trust.BUILT)["build"] == BUILD

    monkeypatch.delenv(STATE_ENV)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert local_trust.trust_dir() == tmp_path / "xdg" / "hybrid-build" / "trust"
    assert local_trust.recalled(BUILD, local_trust.BUILT) is None  # another folder: not recorded there

    monkeypatch.setenv(local_trust.TRUST_ENV, str(tmp_path / "own"))
    assert local_trust.trust_dir() == tmp_path / "own"


def test_a_fifo_in_a_records_place_is_no_record(tmp_path, monkeypatch):
    monkeypatch.setenv(local_trust.TRUST_ENV, str(tmp_path))
    (tmp_path / BUILD).mkdir()
    os.mkfifo(tmp_path / BUILD / f"{local_trust.VALIDATED}.json")
    assert local_trust.recalled(BUILD, local_trust.VALIDATED) is None
