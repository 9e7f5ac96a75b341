"""What `HfApi.upload_large_folder` would do to an artifact, against what `publish` needs, with the
huggingface_hub installed here: whether it warns it is deprecated, which of `publish`'s upload
arguments it takes, and which files it writes into the folder it uploads before its first network
call to send a file (the Hub stood in for: `create_repo` and `list_repo_commits` answer locally, and
the run is stopped where its upload workers would start).

    python lab/probes/upload_large_folder.py ARTIFACT

Runs on a copy of ARTIFACT in a temporary folder; ARTIFACT is not changed. A probe: it prints.
"""
from __future__ import annotations

import inspect
import shutil
import sys
import tempfile
import warnings
from pathlib import Path


class Stop(Exception):
    """Raised where the upload workers would start: nothing is sent."""


def main() -> None:
    import huggingface_hub
    from huggingface_hub import HfApi, RepoUrl
    from huggingface_hub import _upload_large_folder as large

    print(f"huggingface_hub {huggingface_hub.__version__}")
    wanted = ("commit_message", "commit_description", "create_pr", "revision", "allow_patterns", "private")
    params = inspect.signature(HfApi.upload_large_folder).parameters
    folder_params = inspect.signature(HfApi.upload_folder).parameters
    for name in wanted:
        print(f"  {name:<20} upload_folder: {'yes' if name in folder_params else 'no':<4} "
              f"upload_large_folder: {'yes' if name in params else 'no'}")

    class LocalHub(HfApi):
        def create_repo(self, repo_id, **kw):
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def list_repo_commits(self, repo_id, **kw):
            return []

    def stop(*a, **kw):
        raise Stop

    large.LargeUploadStatus = stop
    with tempfile.TemporaryDirectory() as tmp:
        art = Path(tmp) / "artifact"
        shutil.copytree(sys.argv[1], art, ignore=shutil.ignore_patterns(".hybrid-build"))
        before = {p.relative_to(art).as_posix() for p in art.rglob("*")}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                LocalHub(token=False).upload_large_folder("me/demo", art, repo_type="model", print_report=False)
            except Stop:
                pass
        deprecated = [w for w in caught if issubclass(w.category, FutureWarning)]
        print(f"FutureWarning on call: {len(deprecated)}: " + (" ".join(str(deprecated[0].message).split())[:160]
                                                              if deprecated else "-"))
        new = sorted({p.relative_to(art).as_posix() for p in art.rglob("*")} - before)
        files = [n for n in new if (art / n).is_file()]
        print(f"written into the uploaded folder before any file is sent: {len(new)} paths, {len(files)} files, "
              f"e.g. {', '.join(files[:3])}")


if __name__ == "__main__":
    main()
