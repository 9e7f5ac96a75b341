"""The few typed errors of hybrid-build and the exit code each maps to.

A user mistake (bad path, bad recipe, bad argument) is a ``UserError``: the CLI prints one line
and exits 2. A problem found in a checkpoint or artifact while working is an ``ArtifactError``
and a numerics check that fails is a ``NumericsError``: both exit 1. What could not run here (a
server that does not answer, an engine or tool that is missing, no GPU, no Hub) is a ``CannotRun``
or a ``CannotVerify``: exit 3, neither a pass nor a failure.

| exit | outcome |
|---|---|
| 0 | passed |
| 1 | a check failed (or a tool ran and failed) |
| 2 | bad input: fixing the command line fixes it |
| 3 | could not run here |

A server's answers (``core/http_client.py``): nothing answers, or an answer the protocol does not
allow (HTML, not JSON, not Prometheus text, cut off, not UTF-8, over the size cap, nested too deep)
-> exit 3, nothing could be measured against it; a redirect -> exit 2 (give the server's own URL);
a 401/403 -> exit 2 (the API key); any other error status -> exit 1 (the server ran and failed).
"""


class HybridBuildError(Exception):
    """Base class; ``exit_code`` is what the CLI returns."""

    exit_code = 1


class UserError(HybridBuildError):
    """The input or the request is wrong; fixing the command line fixes it."""

    exit_code = 2


class SourceError(UserError):
    """The source checkpoint cannot be read as a checkpoint (missing files, bad headers)."""


class RecipeError(UserError):
    """A recipe does not validate; the message names the field."""


class ArtifactError(HybridBuildError):
    """An output or intermediate artifact is inconsistent, or a stage could not complete."""


class NumericsError(HybridBuildError):
    """A numerics check failed its threshold."""


class ExternalToolError(HybridBuildError):
    """A tool we drive (vLLM, Docker, lm-eval, the Hub) ran and failed."""


class CannotRun(ExternalToolError):
    """The command could not run here: a server that does not answer, an engine or tool that is not
    installed, no GPU, no Hub (offline, unreachable, down). Exit 3. An ``ExternalToolError`` too, so
    that code which records "could not run" for a failed tool (validate's engines) catches both."""

    exit_code = 3


class CannotVerify(HybridBuildError):
    """A check against a running server could not run: nothing answers, another model is served, no
    prompt log-probabilities, no reference to compare with. Neither a pass nor a failure: exit 3."""

    exit_code = 3


class ServerUnreachable(CannotRun, CannotVerify):
    """No server answers at a URL, the connection broke, or the request's deadline passed. Both a tool
    that could not run (``bench``, ``serve``) and a check that could not run (``verify``): exit 3."""


class ProtocolViolation(CannotRun, CannotVerify):
    """A server answered what its protocol does not allow: an HTML page or other text where JSON is
    due, JSON nested too deep to read, bytes that are not UTF-8, a body cut off or over the client's
    size cap, a ``/metrics`` that is not Prometheus text. Nothing can be measured against it: exit 3."""


class RedirectRefused(UserError):
    """A server answered with a redirect. It is not followed, so the request and its API key go only to
    the URL given; giving the server's own URL fixes it: exit 2."""


class ErrorStatus(ExternalToolError):
    """A server answered an error status (>= 400, other than 401/403): it ran and failed, exit 1.
    ``status`` and ``detail`` (the body's first line) let a caller word it or go on; ``message`` is
    the server's own words where the body is an OpenAI-style JSON error (``error.message``), else None."""

    def __init__(self, url: str, status: int, detail: str = "", message: str | None = None) -> None:
        super().__init__(f"{url} answered HTTP {status}" + (f": {detail}" if detail else ""))
        self.url, self.status, self.detail, self.message = url, status, detail, message


class KeyRefused(UserError):
    """A server answered 401/403: it wants an API key and got none or another one. Fixing the
    command line (``--api-key``, ``OPENAI_API_KEY``) fixes it: exit 2."""


class SourceMismatch(UserError):
    """A source given or recorded is not, by content, the one the artifact was built from."""


class StorageError(UserError):
    """The output's filesystem cannot take what a command writes: no space, read-only, not
    writable. The message names the path; another folder, or freed space, fixes it: exit 2."""


class StageFailed(NumericsError):
    """A stage ran and its result failed its checks (validation); ``details`` is its report."""

    def __init__(self, message: str, details: dict) -> None:
        super().__init__(message)
        self.details = details
