"""One mapping from Hugging Face Hub failures to one-line errors that name the cause.

huggingface_hub raises a family of exceptions: ``GatedRepoError`` (a ``RepositoryNotFoundError``,
itself an ``HfHubHTTPError``), ``RevisionNotFoundError``, ``RemoteEntryNotFoundError``, a plain
``HfHubHTTPError`` for 401/403/429/5xx, ``OfflineModeIsEnabled``, ``HFValidationError`` for a bad
repo id, and ``LocalEntryNotFoundError`` when a download fell back to the cache and found nothing,
with the connection error, the offline switch or the HTTP error that caused the fallback chained
as its ``__cause__``. ``classify`` reduces any of them to a cause, and ``hub_error`` turns that into
one of our typed errors with one line: what failed, why, and what to do. Downloads
(``checkpoint.resolve_source``) and uploads (``publish``) both go through here.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from .errors import CannotRun, ExternalToolError, HybridBuildError, UserError

# causes the user fixes (exit 2); no Hub to talk to here: offline, unreachable, down (exit 3); any
# other failure of the Hub's (exit 1)
USER_CAUSES = {"not-found", "gated", "unauthorized", "forbidden", "revision-not-found", "file-not-found", "disabled",
               "invalid-id"}
NO_HUB_CAUSES = {"offline", "unreachable", "rate-limited", "server-error"}


@dataclass(frozen=True)
class HubFailure:
    """A Hub failure reduced to what the user needs: ``cause``, the HTTP status, the library's
    first line, and the exception it came from."""

    cause: str  # offline | unreachable | not-found | gated | unauthorized | forbidden | revision-not-found |
    #             file-not-found | disabled | invalid-id | rate-limited | server-error | other
    status: int | None
    detail: str
    exc: BaseException


def hub_exceptions() -> tuple[type[BaseException], ...]:
    """The exception types that mean "the Hub, or the way to it, failed" (for ``except`` clauses)."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, OfflineModeIsEnabled

    return (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, HFValidationError, httpx.TransportError,
            ConnectionError, TimeoutError)


def _status(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def classify(exc: BaseException) -> HubFailure:
    import httpx
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, LocalEntryNotFoundError):
        # the download fell back to the cache; the reason it could not ask the Hub is chained
        for cause in _chain(exc)[1:]:
            if isinstance(cause, (HfHubHTTPError, OfflineModeIsEnabled, httpx.TransportError, ConnectionError,
                                  TimeoutError)):
                inner = classify(cause)
                return HubFailure(inner.cause, inner.status, inner.detail, exc)
        if "traffic has been disabled" in str(exc) or _offline_env():
            return HubFailure("offline", None, _first_line(exc), exc)
        return HubFailure("unreachable", None, _first_line(exc), exc)
    if isinstance(exc, OfflineModeIsEnabled):
        return HubFailure("offline", None, _first_line(exc), exc)
    if isinstance(exc, HFValidationError):
        return HubFailure("invalid-id", None, _first_line(exc), exc)
    status = _status(exc)
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError: it is one
        return HubFailure("gated", status, _first_line(exc), exc)
    if isinstance(exc, RepositoryNotFoundError):
        return HubFailure("not-found", status, _first_line(exc), exc)
    if isinstance(exc, RevisionNotFoundError):
        return HubFailure("revision-not-found", status, _first_line(exc), exc)
    if isinstance(exc, RemoteEntryNotFoundError):
        return HubFailure("file-not-found", status, _first_line(exc), exc)
    if isinstance(exc, DisabledRepoError):
        return HubFailure("disabled", status, _first_line(exc), exc)
    if isinstance(exc, HfHubHTTPError) or status is not None:
        server = getattr(exc, "server_message", None)
        detail = (server.strip().splitlines()[0] if isinstance(server, str) and server.strip() else _first_line(exc))
        cause = {401: "unauthorized", 403: "forbidden", 404: "not-found", 429: "rate-limited"}.get(status)
        if cause is None:
            cause = "server-error" if status is not None and status >= 500 else "other"
        return HubFailure(cause, status, detail, exc)
    if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError)):
        return HubFailure("unreachable", None, _first_line(exc) if str(exc) else type(exc).__name__, exc)
    return HubFailure("other", status, _first_line(exc), exc)


def _offline_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def _has_token() -> bool:
    try:
        from huggingface_hub import get_token

        return bool(get_token())
    except Exception:  # noqa: BLE001 - a broken token file only means "no token" here
        return False


LOGIN = "log in with `hf auth login` or set HF_TOKEN"


def hub_message(failure: HubFailure, subject: str, *, upload: bool = False, repo_id: str | None = None,
                revision: str | None = None, has_token: bool | None = None) -> str:
    """One line for ``failure``: ``subject`` says what was being done (a repo id, or e.g.
    ``create repo my-org/x``), ``upload`` picks the advice for publishing."""
    repo = repo_id or subject
    token = _has_token() if has_token is None else has_token
    c, status = failure.cause, failure.status
    http = f"HTTP {status}" if status else ""
    paren = f" ({http})" if http else ""
    if c == "offline":
        if upload:
            return "HF_HUB_OFFLINE is set: publishing needs the network (unset it, or use --dry-run)"
        return (f"{subject}: not in the local Hub cache, and HF_HUB_OFFLINE is set: unset it to download, "
                "or pass a local folder")
    if c == "unreachable":
        where = "" if upload else ", and it is not in the local Hub cache"
        return f"{subject}: cannot reach the Hub ({failure.detail}){where}: check the network connection or HF_ENDPOINT"
    if c == "not-found":
        why = "the token cannot see it" if token else f"no token was sent ({LOGIN})"
        return f"{subject}: not found on the Hub{paren}: no such repository, or it is private and {why}"
    if c == "gated":
        step = "with the account of your token" if token else f"then {LOGIN}"
        return (f"{subject}: a gated repository{paren}: accept its conditions at "
                f"https://huggingface.co/{repo} {step}")
    if c == "unauthorized":
        what = "the token was refused (invalid or expired)" if token else "the request needs a token"
        return f"{subject}: unauthorized{paren}: {what}: {LOGIN}"
    if c == "forbidden":
        need = "write access to that namespace" if upload else f"read access to {repo}"
        return f"{subject}: the Hub refused access to {repo}{paren}: the token needs {need}"
    if c == "revision-not-found":
        rev = f"revision {revision!r}" if revision else "the revision"
        return f"{subject}: {rev} not found on the Hub{paren}: give a branch, tag or commit of {repo}"
    if c == "file-not-found":
        return f"{subject}: a file is missing from the repository ({failure.detail})"
    if c == "disabled":
        return f"{subject}: the repository is disabled on the Hub{paren}"
    if c == "invalid-id":
        return f"{subject}: not a valid Hub repo id ({failure.detail})"
    if c == "rate-limited":
        return f"{subject}: the Hub is rate-limiting requests{paren}: wait a few minutes and run the same command again"
    if c == "server-error":
        return f"{subject}: the Hub failed ({http or 'server error'}: {failure.detail}): try again later"
    return f"{subject}: the Hub request failed ({type(failure.exc).__name__}: {failure.detail})"


def hub_error(exc: BaseException, subject: str, *, upload: bool = False, repo_id: str | None = None,
              revision: str | None = None, redact: Callable[[str], str] = lambda s: s,
              suffix: str = "", has_token: bool | None = None) -> HybridBuildError:
    """Our error for a Hub failure: a ``UserError`` (exit 2) when the user can fix it (not found,
    gated, unauthorized, forbidden, bad revision), a ``CannotRun`` (exit 3) when there is no Hub to
    talk to (offline, unreachable, rate-limited, down), else an ``ExternalToolError`` (exit 1); the
    last two with ``suffix`` appended (e.g. how to resume). One line, with ``redact`` applied.
    ``has_token`` says whether a token was sent (default: whether huggingface_hub finds one)."""
    failure = classify(exc)
    text = redact(hub_message(failure, subject, upload=upload, repo_id=repo_id, revision=revision,
                              has_token=has_token))
    text = " ".join(text.split("\n"))
    if failure.cause in USER_CAUSES:
        return UserError(text)
    if failure.cause in NO_HUB_CAUSES:
        return CannotRun(text + suffix)
    return ExternalToolError(text + suffix)
