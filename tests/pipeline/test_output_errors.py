"""A write to the output that the filesystem refuses (full, read-only, no permission, too large) is
one line naming the OUTPUT file that could not be written, exit 2, and leaves neither that file under
its final name nor its temporary file.

Each case runs ``hybrid-build run`` in a child process whose OS-level calls fail for one output file
only: its writes (``sendfile``, ``copy_file_range``, ``pwrite``, ``write`` and a buffered file's
``write``: what ``shutil`` and the shard writer use) with ENOSPC, or the open of the file's temporary
name with EACCES or EROFS; and one case where the kernel itself refuses a write (``RLIMIT_FSIZE``,
SIGXFSZ ignored: EFBIG), set just before the source's other files are copied.
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybrid_build.core.artifact import IN_PROGRESS

CHILD = textwrap.dedent("""
    import builtins, errno, os, resource, signal, sys
    from pathlib import Path

    OUT, TARGET, HOW, CODE = sys.argv[1], sys.argv[2], sys.argv[3], getattr(errno, sys.argv[4])

    def hit(path):  # the target's final or temporary name in the output folder
        path = os.path.abspath(os.fspath(path))
        return os.path.dirname(path) == OUT and os.path.basename(path).split(".partial")[0] == TARGET

    def fail(path):
        raise OSError(CODE, os.strerror(CODE), *([os.fspath(path)] if path is not None else []))

    if HOW == "copy":  # the bytes going into the file fail, as on a full disk (the calls name no file)
        def fd_path(fd):
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return ""
        def refuse(real, out_arg):
            def call(*a, **kw):
                if hit(fd_path(a[out_arg])):
                    fail(None)
                return real(*a, **kw)
            return call
        os.sendfile = refuse(os.sendfile, 0)
        os.copy_file_range = refuse(os.copy_file_range, 1)
        os.pwrite = refuse(os.pwrite, 0)
        os.write = refuse(os.write, 0)
        real_open = builtins.open
        class Full:  # a buffered file's writes (they reach write(2) without os.write)
            def __init__(self, f):
                self._f = f
            def write(self, data):
                fail(None)
            def __getattr__(self, name):
                return getattr(self._f, name)
            def __enter__(self):
                return self
            def __exit__(self, *a):
                self._f.close()
        def opened(file, mode="r", *a, **kw):
            f = real_open(file, mode, *a, **kw)
            writes = isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax") and hit(file)
            return Full(f) if writes else f
        builtins.open = opened
    elif HOW == "open":  # opening the file for writing fails, as on a read-only or foreign folder
        real_open, real_os_open = builtins.open, os.open
        def opened(file, mode="r", *a, **kw):
            if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax") and hit(file):
                fail(file)
            return real_open(file, mode, *a, **kw)
        def os_opened(path, flags, *a, **kw):
            if flags & (os.O_WRONLY | os.O_RDWR) and hit(path):
                fail(path)
            return real_os_open(path, flags, *a, **kw)
        builtins.open, os.open = opened, os_opened
    elif HOW == "rlimit":  # the kernel refuses the write itself: EFBIG past RLIMIT_FSIZE
        from hybrid_build.pipeline.stages import assemble
        real_copy = assemble.copy_file_atomic
        def limited(src, dst):
            if hit(dst):
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            return real_copy(src, dst)
        assemble.copy_file_atomic = limited

    from hybrid_build.pipeline.cli import main
    sys.exit(main(["run", sys.argv[5], "-o", OUT, "--recipe", "tiny", "--no-validate"]))
""")

CASES = [
    # the source's other files are copied with shutil, which named the SOURCE file on a full disk
    pytest.param("tokenizer.json", "copy", "ENOSPC", id="enospc-copied-file"),
    pytest.param("model-00002-of-00003.safetensors", "copy", "ENOSPC", id="enospc-shard"),
    pytest.param("config.json", "open", "EACCES", id="eacces-config"),
    pytest.param("model-00001-of-00003.safetensors", "open", "EROFS", id="erofs-shard"),
    pytest.param("tokenizer.json", "rlimit", "EFBIG", id="efbig-real-write"),
]


@pytest.mark.parametrize("target,how,code", CASES)
def test_a_refused_write_names_the_output_file_and_leaves_none(tiny_checkpoint, tmp_path, target, how, code):
    out = (tmp_path / "out").resolve()
    p = subprocess.run([sys.executable, "-c", CHILD, str(out), target, how, code, str(tiny_checkpoint)],
                       capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    err = p.stderr.strip().splitlines()
    strerror = os.strerror(getattr(errno, code))
    assert p.returncode == 2, p.stderr
    assert err == [f"error: {out / target}: {strerror}"], p.stderr
    assert str(tiny_checkpoint) not in p.stderr  # never the file it was copied from
    assert not (out / target).exists()
    assert not list(out.glob("*.partial")), "a temporary file was left behind"
    assert not (out / "model.safetensors.index.json").exists()  # and the folder is not a finished build
    assert (out / IN_PROGRESS).is_file()  # serve, publish and status take it for a build that stopped


def test_a_source_that_cannot_be_read_keeps_its_own_name(tmp_path):
    """Only the write side is renamed: an error reading the file copied from still names it."""
    from hybrid_build.core.safetensors_io import copy_file_atomic

    src = tmp_path / "gone.json"
    with pytest.raises(OSError) as e:
        copy_file_atomic(src, tmp_path / "out" / "gone.json")
    assert e.value.filename == str(src) and e.value.errno == errno.ENOENT
    assert not list((tmp_path / "out").iterdir())


def test_no_partial_under_a_full_disk_of_a_text_file(tmp_path, monkeypatch):
    """``write_text_atomic`` on a full disk: the final name, no temporary file left."""
    from hybrid_build.core import safetensors_io

    class Full:
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("builtins.open", lambda *a, **kw: Full())
    target = tmp_path / "config.json"
    with pytest.raises(OSError) as e:
        safetensors_io.write_text_atomic(target, "{}")
    monkeypatch.undo()
    assert e.value.filename == str(target) and e.value.errno == errno.ENOSPC
    assert not target.exists() and not list(Path(tmp_path).iterdir())
