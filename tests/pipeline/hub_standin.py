"""A stand-in for the Hub at the ``HfApi`` boundary (the publish tests' only stand-in).

``StandInHub`` implements the ``HfApi`` methods the publisher calls, with the same signatures and
return types (``RepoUrl``, ``CommitInfo``, ``RepoFile``, ``Discussion``). It keeps each branch's
files in memory, records every call and every file whose bytes were sent, selects files for
``upload_folder`` with huggingface_hub's own pattern filter, commits file by file (as the real
multi-commit upload leaves the files of finished commits in place when a later one fails), and
fails on demand: ``fail_on_send[path] = [exc, ...]`` raises while that file is being sent,
``fail_calls[method] = [exc, ...]`` raises when that method is called; each exception is used once.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
from huggingface_hub import CommitInfo, Discussion, RepoUrl
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import filter_repo_objects

FAKE_TOKEN = "hf_StandInSecretToken0123456789abcdef"
LFS_SUFFIXES = (".safetensors", ".png", ".bin")
LFS_MIN_BYTES = 10 * 1024 * 1024


def http_error(status: int, message: str = "server error") -> HfHubHTTPError:
    req = httpx.Request("POST", "https://huggingface.co/api/models/x/commit/main")
    return HfHubHTTPError(f"{status} {message}", response=httpx.Response(status, request=req))


@dataclass
class RemoteRepo:
    private: bool
    branches: dict[str, dict[str, bytes]] = field(
        default_factory=lambda: {"main": {".gitattributes": b"*.safetensors filter=lfs\n"}})
    prs: list[Discussion] = field(default_factory=list)
    # path -> RepoFile field overrides, to fake a remote that holds something else
    tampered: dict[str, dict] = field(default_factory=dict)


class StandInHub:
    def __init__(self, token: str | None = FAKE_TOKEN):
        self.token = token
        self.repos: dict[str, RemoteRepo] = {}
        self.calls: list[tuple[str, dict]] = []
        self.sent: list[tuple[str, int]] = []  # (path, bytes) in the order they were sent
        self.fail_on_send: dict[str, list[BaseException]] = {}
        self.fail_calls: dict[str, list[BaseException]] = {}
        self.commits = 0

    # -- helpers for tests ------------------------------------------------------------------

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        return self.repos[repo_id].branches[revision]

    def sent_paths(self) -> list[str]:
        return [p for p, _ in self.sent]

    def reset_records(self) -> None:
        self.calls.clear()
        self.sent.clear()

    def tamper(self, repo_id: str, path: str, **fields) -> None:
        self.repos[repo_id].tampered[path] = fields

    def _enter(self, name: str, **kwargs) -> None:
        self.calls.append((name, kwargs))
        queue = self.fail_calls.get(name)
        if queue:
            raise queue.pop(0)

    def _branch(self, repo_id: str, revision: str | None) -> dict[str, bytes]:
        repo = self.repos.get(repo_id)
        if repo is None:
            from huggingface_hub.errors import RepositoryNotFoundError

            req = httpx.Request("GET", f"https://huggingface.co/api/models/{repo_id}")
            raise RepositoryNotFoundError("404 repo not found", response=httpx.Response(404, request=req))
        rev = revision or "main"
        if rev not in repo.branches:
            raise http_error(404, f"revision {rev} not found")
        return repo.branches[rev]

    def _repo_file(self, repo_id: str, path: str, data: bytes) -> RepoFile:
        kw = {"path": path, "size": len(data), "oid": hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()}
        if path.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_BYTES:
            kw["lfs"] = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
        over = self.repos[repo_id].tampered.get(path, {})
        if "size" in over:
            kw["size"] = over["size"]
            if "lfs" in kw:
                kw["lfs"]["size"] = over["size"]
        if "sha256" in over and "lfs" in kw:
            kw["lfs"]["oid"] = over["sha256"]
        if "oid" in over:
            kw["oid"] = over["oid"]
        return RepoFile(**kw)

    def _commit(self, repo_id: str, branch: dict, items: list[tuple[str, bytes]], message: str, create_pr, revision):
        """Send and commit file by file; returns CommitInfo (with the PR's url when one was opened)."""
        repo = self.repos[repo_id]
        pr = None
        if create_pr:
            num = len(repo.prs) + 1
            pr = Discussion(title=message, status="open", num=num, repo_id=repo_id, repo_type="model",
                            author="me", is_pull_request=True, created_at=datetime.now(timezone.utc),
                            endpoint="https://huggingface.co")
            repo.prs.append(pr)
            branch = dict(branch)
            repo.branches[f"refs/pr/{num}"] = branch
        for path, data in items:
            queue = self.fail_on_send.get(path)
            if queue:
                self.sent.append((path, len(data) // 2))  # half of it went out before the failure
                raise queue.pop(0)
            self.sent.append((path, len(data)))
            branch[path] = data
            self.commits += 1
        url = f"https://huggingface.co/{repo_id}/commit/{self.commits:040x}"
        pr_url = f"https://huggingface.co/{repo_id}/discussions/{pr.num}" if pr else None
        return CommitInfo(commit_url=url, commit_message=message, commit_description="", oid=f"{self.commits:040x}",
                          pr_url=pr_url)

    # -- the HfApi surface ---------------------------------------------------------------------

    def create_repo(self, repo_id, *, token=None, private=None, repo_type=None, exist_ok=False, **kw):
        self._enter("create_repo", repo_id=repo_id, private=private, exist_ok=exist_ok)
        if repo_id in self.repos and not exist_ok:
            raise http_error(409, "repo exists")
        self.repos.setdefault(repo_id, RemoteRepo(private=bool(private)))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_branch(self, repo_id, *, branch, revision=None, token=None, repo_type=None, exist_ok=False):
        self._enter("create_branch", repo_id=repo_id, branch=branch, exist_ok=exist_ok)
        repo = self.repos[repo_id]
        if branch in repo.branches and not exist_ok:
            raise http_error(409, "branch exists")
        repo.branches.setdefault(branch, dict(repo.branches[revision or "main"]))

    def get_repo_discussions(self, repo_id, *, author=None, discussion_type=None, discussion_status=None,
                             repo_type=None, token=None):
        self._enter("get_repo_discussions", repo_id=repo_id, discussion_type=discussion_type,
                    discussion_status=discussion_status)
        for d in self.repos[repo_id].prs:
            if discussion_status in (None, "all", d.status):
                yield d

    def get_paths_info(self, repo_id, paths, *, expand=False, revision=None, repo_type=None, token=None):
        self._enter("get_paths_info", repo_id=repo_id, paths=list(paths), revision=revision, expand=expand)
        branch = self._branch(repo_id, revision)
        return [self._repo_file(repo_id, p, branch[p]) for p in ([paths] if isinstance(paths, str) else paths)
                if p in branch]

    def list_repo_tree(self, repo_id, path_in_repo=None, *, recursive=False, expand=False, revision=None,
                       repo_type=None, token=None):
        self._enter("list_repo_tree", repo_id=repo_id, recursive=recursive, revision=revision)
        branch = self._branch(repo_id, revision)
        for p in sorted(branch):
            yield self._repo_file(repo_id, p, branch[p])

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, commit_message=None, commit_description=None,
                      token=None, repo_type=None, revision=None, create_pr=None, parent_commit=None,
                      allow_patterns=None, ignore_patterns=None, delete_patterns=None, run_as_future=False):
        self._enter("upload_folder", repo_id=repo_id, allow_patterns=allow_patterns, revision=revision,
                    create_pr=create_pr, commit_message=commit_message)
        branch = self._branch(repo_id, revision)
        root = Path(folder_path)
        rel = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        chosen = list(filter_repo_objects(rel, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        items = [(p, (root / p).read_bytes()) for p in chosen]
        return self._commit(repo_id, branch, items, commit_message or "upload", create_pr, revision)

    def upload_file(self, *, path_or_fileobj, path_in_repo, repo_id, token=None, repo_type=None, revision=None,
                    commit_message=None, commit_description=None, create_pr=None, parent_commit=None,
                    run_as_future=False):
        self._enter("upload_file", repo_id=repo_id, path_in_repo=path_in_repo, revision=revision, create_pr=create_pr)
        branch = self._branch(repo_id, revision)
        data = path_or_fileobj if isinstance(path_or_fileobj, bytes) else Path(path_or_fileobj).read_bytes()
        return self._commit(repo_id, branch, [(path_in_repo, data)], commit_message or "upload", create_pr, revision)
