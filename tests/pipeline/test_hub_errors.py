"""Hub failures name their cause in one line: offline, unreachable, not found, gated,
unauthorized, forbidden, revision not found, Hub down.

Downloads go through the real ``snapshot_download``; only ``HfApi.repo_info`` (its first network
call) is replaced, and it raises what huggingface_hub itself builds from a Hub answer
(``hf_raise_for_status`` on an ``httpx.Response`` with the Hub's ``X-Error-Code`` header), so the
library's own fallback and re-raise logic decides what reaches us. Uploads use the stand-in
``HfApi`` of ``hub_standin.py`` raising the same library-built exceptions.
"""
from __future__ import annotations

import httpx
import pytest
from hub_standin import FAKE_TOKEN
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.utils import hf_raise_for_status

from hybrid_build.core.checkpoint import resolve_source
from hybrid_build.core.errors import CannotRun, UserError
from hybrid_build.core.hub_errors import classify, hub_message
from hybrid_build.pipeline.cli import main
from hybrid_build.pipeline.commands import publish as publish_command

REPO = "some-org/some-model"


def hub_answer(status: int, code: str | None = None, message: str | None = None,
               url: str = f"https://huggingface.co/api/models/{REPO}/revision/main") -> Exception:
    """The exception huggingface_hub raises for this answer of the Hub."""
    headers = {}
    if code:
        headers["X-Error-Code"] = code
    if message:
        headers["X-Error-Message"] = message
    resp = httpx.Response(status, headers=headers, json={"error": message or "error"},
                          request=httpx.Request("GET", url))
    with pytest.raises(Exception) as e:
        hf_raise_for_status(resp)
    return e.value


@pytest.fixture
def online(monkeypatch):
    """Online as far as hybrid-build and huggingface_hub know; ``fail(exc)`` makes the Hub's first
    answer (``repo_info``) raise ``exc``. No request leaves the machine."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def fail(exc: BaseException):
        def repo_info(self, repo_id, *a, **kw):
            calls.append((repo_id, kw.get("revision")))
            raise exc
        monkeypatch.setattr(HfApi, "repo_info", repo_info)
        return calls
    return fail


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_offline_with_an_empty_cache(capsys):
    # HF_HUB_OFFLINE=1 (set for every test): the real snapshot_download looks in the empty cache
    with pytest.raises(CannotRun, match=f"^{REPO}: not in the local Hub cache, and HF_HUB_OFFLINE is set"):
        resolve_source(REPO)
    assert main(["inspect", REPO]) == 3  # no Hub here: could not run
    assert "HF_HUB_OFFLINE" in one_error(capsys)


def test_offline_mode_raised_by_the_library(online):
    online(OfflineModeIsEnabled("Cannot reach https://huggingface.co/api/models: offline mode is enabled."))
    with pytest.raises(CannotRun, match="HF_HUB_OFFLINE is set"):
        resolve_source(REPO)


def test_unreachable_hub(online, capsys):
    calls = online(httpx.ConnectError("[Errno -3] Temporary failure in name resolution",
                                      request=httpx.Request("GET", f"https://huggingface.co/api/models/{REPO}")))
    with pytest.raises(CannotRun, match=r"cannot reach the Hub \(.*name resolution.*\).*not in the local Hub cache"):
        resolve_source(REPO)
    assert calls == [(REPO, "main")]
    assert main(["inspect", REPO]) == 3
    one_error(capsys)


def test_not_found_without_a_token_says_to_log_in(online, capsys):
    online(hub_answer(404, "RepoNotFound"))
    with pytest.raises(UserError,
                       match=f"^{REPO}: not found on the Hub \\(HTTP 404\\).*no token was sent.*hf auth login"):
        resolve_source(REPO)
    assert main(["inspect", REPO]) == 2
    one_error(capsys)


def test_not_found_with_a_token(online, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    online(hub_answer(404, "RepoNotFound"))
    with pytest.raises(UserError, match="private and the token cannot see it") as e:
        resolve_source(REPO)
    assert FAKE_TOKEN not in str(e.value)


def test_gated_repo(online):
    online(hub_answer(403, "GatedRepo"))
    with pytest.raises(UserError, match=f"a gated repository \\(HTTP 403\\): accept its conditions at "
                                        f"https://huggingface.co/{REPO}"):
        resolve_source(REPO)


def test_rejected_token_is_unauthorized(online, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    online(hub_answer(401, message="Invalid credentials in Authorization header"))
    with pytest.raises(UserError, match=r"unauthorized \(HTTP 401\): the token was refused \(invalid or expired\)"):
        resolve_source(REPO)


def test_forbidden(online):
    # a 403 that is not a gated repo: the library falls back to the cache, finds nothing and
    # chains the refusal; the cause is read from the chain
    online(hub_answer(403, message="forbidden"))
    with pytest.raises(UserError,
                       match=f"the Hub refused access to {REPO} \\(HTTP 403\\): the token needs read access"):
        resolve_source(REPO)


def test_revision_not_found(online):
    calls = online(hub_answer(404, "RevisionNotFound"))
    with pytest.raises(UserError, match="revision 'v9' not found on the Hub \\(HTTP 404\\)"):
        resolve_source(REPO, revision="v9")
    assert calls == [(REPO, "v9")]


def test_hub_down_is_not_a_user_error(online, capsys):
    online(hub_answer(503, message="Service Unavailable"))
    with pytest.raises(CannotRun, match=r"the Hub failed \(HTTP 503"):
        resolve_source(REPO)
    assert main(["inspect", REPO]) == 3
    one_error(capsys)


def test_every_cause_has_its_own_sentence():
    cases = {
        "not-found": hub_answer(404, "RepoNotFound"),
        "gated": hub_answer(401, "GatedRepo"),
        "revision-not-found": hub_answer(404, "RevisionNotFound"),
        "unauthorized": hub_answer(401, message="Invalid credentials in Authorization header"),
        "forbidden": hub_answer(403),
        "rate-limited": hub_answer(429),
        "server-error": hub_answer(502),
        "offline": OfflineModeIsEnabled("offline"),
        "unreachable": httpx.ConnectTimeout("timed out"),
    }
    messages = {}
    for cause, exc in cases.items():
        failure = classify(exc)
        assert failure.cause == cause, (cause, failure)
        messages[cause] = hub_message(failure, REPO, has_token=True)
        assert "\n" not in messages[cause]
    assert len(set(messages.values())) == len(messages)


# ------------------------------------------------------------------------------------ uploads


@pytest.fixture
def cli(monkeypatch, hub, no_sleep):
    policy, _ = no_sleep
    monkeypatch.setattr(publish_command, "make_api", lambda: hub)
    monkeypatch.setattr(publish_command, "make_retry", lambda: policy)
    return lambda *args: main(["publish", *map(str, args)])


@pytest.mark.parametrize("exc, code, says", [
    (hub_answer(403, "GatedRepo", url="https://huggingface.co/api/repos/create"), 2, "a gated repository"),
    (hub_answer(401, message="Invalid credentials in Authorization header", url="https://huggingface.co/api/repos/create"),
     2, "unauthorized (HTTP 401): the token was refused"),
    (hub_answer(403, message="You don't have the rights to create a model under this namespace",
                url="https://huggingface.co/api/repos/create"), 2, "the token needs write access to that namespace"),
    (OfflineModeIsEnabled("offline mode is enabled"), 3, "HF_HUB_OFFLINE is set: publishing needs the network"),
], ids=["gated", "unauthorized", "forbidden", "offline"])
def test_publish_names_the_cause(artifact, cli, hub, capsys, exc, code, says):
    hub.fail_calls["create_repo"] = [exc]
    assert cli(artifact, "--repo-id", "my-org/tiny-hybrid") == code
    err = one_error(capsys)
    assert says in err and FAKE_TOKEN not in err
    assert [name for name, _ in hub.calls] == ["create_repo"], "a refusal is not retried"


def test_publish_into_a_repo_the_token_cannot_see(artifact, cli, hub, capsys):
    # the repo "exists" (create_repo with exist_ok answers) but reading its files says 404
    hub.fail_calls["get_paths_info"] = [hub_answer(404, "RepoNotFound",
                                                   url="https://huggingface.co/api/models/my-org/tiny-hybrid/paths-info/main")]
    assert cli(artifact, "--repo-id", "my-org/tiny-hybrid") == 2
    err = one_error(capsys)
    assert "read remote files (my-org/tiny-hybrid): not found on the Hub (HTTP 404)" in err
    assert "the token cannot see it" in err
