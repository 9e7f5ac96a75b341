"""Safetensors at the byte level: read headers without touching data, and write shards in a stream.

The safetensors layout is ``u64 header length | JSON header | tensor bytes``; every tensor's
``data_offsets`` are relative to the first byte after the header. Reading a header costs two
small reads, so inspecting a 70 GB checkpoint reads a few megabytes.

The writer plans every shard (names, header, offsets) from metadata before writing a byte,
copies an unchanged tensor as a byte range from its source file (no tensor is built), takes a
changed tensor from a producer that yields bounded chunks, writes each shard under a temporary
name and renames it when complete. The index is written last, so a folder that has one is whole.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import mmap
import os
import queue
import shutil
import stat as stat_mod
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .bounded_read import check_depth
from .errors import ArtifactError, SourceError

log = logging.getLogger(__name__)

# bytes per element for every dtype string safetensors writes
DTYPE_SIZES: dict[str, float] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
    "F4": 0.5,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
COPY_CHUNK = 64 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"
TMP_SUFFIX = ".partial"


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as its file's header describes it; ``start`` is an absolute file offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FileHeader:
    path: Path
    tensors: dict[str, TensorHeader]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    if dtype not in DTYPE_SIZES:
        raise ArtifactError(f"unknown safetensors dtype {dtype!r}")
    return int(math.ceil(math.prod(shape) * DTYPE_SIZES[dtype]))


_SPECIAL = ((stat_mod.S_ISFIFO, "a FIFO"), (stat_mod.S_ISSOCK, "a socket"), (stat_mod.S_ISCHR, "a character device"),
            (stat_mod.S_ISBLK, "a block device"), (stat_mod.S_ISDIR, "a folder"),
            (stat_mod.S_ISLNK, "a symbolic link"))  # an lstat's: an artifact's files are never followed


def special_kind(st: os.stat_result) -> str | None:
    """What a file that is not a regular one is ("a FIFO", ...); None for a regular file. Such a
    file is never opened for reading: a FIFO would wait for a writer."""
    if stat_mod.S_ISREG(st.st_mode):
        return None
    return next((what for test, what in _SPECIAL if test(st.st_mode)), "not a regular file")


def open_regular(path: str | os.PathLike, error: type[Exception] = SourceError):
    """``path`` opened for reading in binary, refused (``error`` naming the file) unless it is a
    regular file; opened non-blocking, so a FIFO put in its place meanwhile cannot hang the read."""
    path = Path(path)
    kind = special_kind(os.stat(path))
    if kind is None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        if stat_mod.S_ISREG(os.fstat(fd).st_mode):
            return os.fdopen(fd, "rb")
        kind = special_kind(os.fstat(fd))
        os.close(fd)
    raise error(f"{path.name} is {kind}, not a regular file")


def read_header(path: str | os.PathLike) -> FileHeader:
    """Parse one file's header; raise ``SourceError`` naming the file for anything malformed (a
    FIFO or device in a file's place included, never read)."""
    path = Path(path)
    size = path.stat().st_size
    with open_regular(path) as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SourceError(f"{path.name}: not a safetensors file (only {size} bytes)")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > MAX_HEADER_BYTES:
            raise SourceError(f"{path.name}: not a safetensors file (header length {hlen} is implausible)")
        if 8 + hlen > size:
            raise SourceError(f"{path.name}: truncated safetensors header ({hlen} header bytes declared, "
                              f"{size - 8} present)")
        blob = f.read(hlen)
    try:
        check_depth(blob.decode("utf-8", "replace"), f"{path.name}: safetensors header")  # never a RecursionError
        header = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        why = e.msg if hasattr(e, "msg") else e
        raise SourceError(f"{path.name}: not a safetensors file (header is not JSON: {why})")
    if not isinstance(header, dict):
        raise SourceError(f"{path.name}: not a safetensors file (header is not a JSON object)")
    return header_from_json(path, header, 8 + hlen, size)


def header_from_json(path: Path, header: dict, data_start: int, size: int) -> FileHeader:
    """A file's parsed JSON header checked as safetensors reads it: each entry's dtype, shape and span,
    every tensor inside the file of ``size`` bytes whose data begins at ``data_start``, and the
    tensors covering the data (``_check_coverage``). Shared by the local reader and the Hub's
    (``hub_headers``); ``SourceError`` naming the file for anything malformed."""
    metadata = header.get("__metadata__") or {}
    tensors: dict[str, TensorHeader] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            if not (isinstance(dtype, str) and all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi))):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise SourceError(f"{path.name}: malformed header entry for {name!r}")
        expected = tensor_nbytes(dtype, shape) if dtype in DTYPE_SIZES else hi - lo
        if hi - lo != expected or lo < 0:
            raise SourceError(
                f"{path.name}: tensor {name!r} spans {hi - lo} bytes, its dtype and shape need {expected}")
        if data_start + hi > size:
            raise SourceError(f"{path.name}: truncated: tensor {name!r} ends at byte {data_start + hi}, "
                              f"file has {size}")
        tensors[name] = TensorHeader(name, dtype, shape, data_start + lo, hi - lo)
    _check_coverage(path, tensors, data_start, size)
    return FileHeader(path, tensors, metadata, data_start, size)


def _check_coverage(path: Path, tensors: dict[str, TensorHeader], data_start: int, size: int) -> None:
    """The data as safetensors itself reads it: sorted by offset, the tensors start at 0, each begins
    where the one before ends (no gap, no overlap: "invalid offset"), and the last ends at the end of
    the file (no trailing bytes: "file not fully covered"). One ``SourceError`` naming the tensor."""
    end, prev = 0, None
    for t in sorted(tensors.values(), key=lambda t: (t.start, t.start + t.nbytes)):
        lo = t.start - data_start
        if lo < end:
            raise SourceError(f"{path.name}: tensor {t.name!r} starts at data offset {lo}, inside {prev!r} "
                              f"(which ends at {end}): overlapping data_offsets, which safetensors refuses")
        if lo > end:
            after = f"after {prev!r} ends at {end}" if prev else "after the header, where no tensor starts"
            raise SourceError(f"{path.name}: tensor {t.name!r} starts at data offset {lo}, {lo - end} byte(s) "
                              f"{after}: a gap in the data_offsets, which safetensors refuses")
        end, prev = lo + t.nbytes, t.name
    trailing = size - data_start - end
    if trailing > 0:
        last = f"after the last tensor, {prev!r}" if prev else "after the header, which lists no tensor"
        raise SourceError(f"{path.name}: {trailing} byte(s) {last}: safetensors refuses a file its tensors "
                          "do not fully cover")


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class ByteRange:
    """An unchanged tensor: copied from ``path`` as bytes. ``ready``, if set, is called before
    the file is read and blocks until it is complete (a file another stage is still writing)."""

    path: Path
    start: int
    nbytes: int
    ready: Callable[[], None] | None = field(default=None, compare=False, repr=False)


ChunkProducer = Callable[[], Iterator[bytes | memoryview]]


@dataclass
class OutTensor:
    """A tensor to write: either a byte range of a source file, or a producer of its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: ByteRange | ChunkProducer

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


@dataclass
class ShardPlan:
    """One output file: its tensors in order and the exact header that will precede them."""

    filename: str
    tensors: list[OutTensor]
    metadata: dict[str, str] = field(default_factory=lambda: {"format": "pt"})
    in_index: bool = True

    def header_bytes(self) -> bytes:
        header: dict = {"__metadata__": self.metadata} if self.metadata else {}
        offset = 0
        for t in self.tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned, as the reference writer does
        return struct.pack("<Q", len(blob)) + blob

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def total_bytes(self) -> int:
        return len(self.header_bytes()) + self.data_bytes


def plan_shards(tensors: list[OutTensor], max_shard_bytes: int, prefix: str = "model") -> list[ShardPlan]:
    """Split tensors, in the given order, into shards of at most ``max_shard_bytes`` of data
    (a tensor larger than that gets a shard to itself) named ``{prefix}-0000i-of-0000n.safetensors``."""
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    if n == 1:
        return [ShardPlan(f"{prefix}.safetensors", groups[0])]
    return [ShardPlan(f"{prefix}-{i:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups, 1)]


def _copy_range(src: ByteRange, dst, buf: bytearray | None = None) -> None:
    with open(src.path, "rb") as f:
        left, pos = src.nbytes, src.start
        copy_file_range = getattr(os, "copy_file_range", None)
        if copy_file_range is not None:
            dst.flush()
            try:
                while left:
                    n = copy_file_range(f.fileno(), dst.fileno(), min(left, 1 << 30), pos)
                    if n == 0:
                        raise ArtifactError(f"{src.path.name}: ended early while copying bytes {src.start}..")
                    left -= n
                    pos += n
                dst.seek(0, os.SEEK_END)
                return
            except OSError:  # e.g. across filesystems on old kernels: fall back to a buffered copy
                dst.seek(0, os.SEEK_END)
                if left != src.nbytes:
                    raise
        f.seek(pos)
        buf = buf if buf is not None else bytearray(COPY_CHUNK)
        view = memoryview(buf)
        while left:
            n = f.readinto(view[: min(left, len(buf))])
            if not n:
                raise ArtifactError(f"{src.path.name}: ended early while copying bytes {src.start}..")
            dst.write(view[:n])
            left -= n


class ShardHasher:
    """sha256 of a shard's bytes in write order, computed on a worker thread.

    The writer feeds it chunks it produced and byte ranges it copied; a range is hashed straight
    from the source file's page cache through a memory map (no copy into user memory, and the
    copy itself stays in the kernel with ``copy_file_range``). hashlib releases the GIL on
    large buffers, so hashing (~1.3 GB/s a core) overlaps the copying; hashing the written file
    afterwards would re-read it from disk once the output outgrows the page cache (a 16 GB build
    on a 24 GB machine did)."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=8)  # at most 8 chunks in flight
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            chunk, done = item
            try:
                if self._error is not None:
                    pass  # keep draining so that the writer never blocks on a full queue
                elif isinstance(chunk, ByteRange):
                    _hash_range(self._sha, chunk)
                else:
                    self._sha.update(chunk)
            except BaseException as e:  # noqa: BLE001  (reported by hexdigest())
                self._error = e
            finally:
                del chunk
                if done is not None:
                    done()

    def feed(self, chunk, done: Callable[[], None] | None = None) -> None:
        """Hash ``chunk`` (kept unchanged until ``done``, if given, is called after hashing)."""
        self._queue.put((chunk, done))

    def feed_range(self, rng: ByteRange) -> None:
        """Hash ``rng`` of its file (which must not change until ``hexdigest`` returns)."""
        self._queue.put((rng, None))

    def hexdigest(self) -> str:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._sha.hexdigest()


HASH_WINDOW = 64 * 1024 * 1024  # bytes mapped at a time (the mapped pages count as resident)


def _hash_range(sha, rng: ByteRange) -> None:
    """Feed ``rng`` to ``sha`` through memory-mapped windows, each populated in one call."""
    if rng.nbytes == 0:
        return
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with open(rng.path, "rb") as f:
        if os.fstat(f.fileno()).st_size < rng.start + rng.nbytes:
            raise ArtifactError(f"{rng.path.name}: ended early while hashing bytes {rng.start}..")
        pos, end = rng.start, rng.start + rng.nbytes
        while pos < end:
            base = pos - pos % mmap.ALLOCATIONGRANULARITY
            length = min(end, base + HASH_WINDOW) - base
            m = mmap.mmap(f.fileno(), length, flags=flags, prot=mmap.PROT_READ, offset=base)
            try:
                with memoryview(m) as view, view[pos - base:] as part:
                    sha.update(part)
            finally:
                m.close()
            pos = base + length


DIRECT_ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffer addresses aligned to the block size
DIRECT_BUFFER = 32 * 1024 * 1024
DIRECT_BUFFERS = 4  # per shard being written: filled, hashed and written in a pipeline


class _Slot:
    """A page-aligned staging buffer, returned to the free queue once hashed and written."""

    def __init__(self, free: queue.Queue) -> None:
        self.buf = mmap.mmap(-1, DIRECT_BUFFER)
        self._free, self._pending, self._lock = free, 0, threading.Lock()

    def hold(self, users: int) -> None:
        self._pending = users

    def release(self) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._free.put(self)


class _DirectStream:
    """Writes one file front to back with ``O_DIRECT`` from aligned staging buffers.

    The page cache is bypassed for the output: no page allocation, no copy into it and no
    write-back later, which on the development machine's virtual disk made writing 5 GB cost
    ~1.2 s of CPU instead of ~6.5 s (benchmarks/bench_run.py). The calling thread fills a
    buffer (``preadv`` from the source file, or a producer's bytes); each full buffer goes to
    the hasher's thread and to this stream's writer thread at once and is refilled when both
    are done. The last block is padded to the alignment and the file truncated to its size."""

    def __init__(self, path: Path, hasher: ShardHasher | None) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            probe = mmap.mmap(-1, DIRECT_ALIGN)
            os.pwrite(self.fd, probe, 0)  # a filesystem may accept the flag and refuse the write
        except OSError:
            os.close(self.fd)
            raise
        self.hasher = hasher
        self.free: queue.Queue = queue.Queue()
        for _ in range(DIRECT_BUFFERS):
            self.free.put(_Slot(self.free))
        self.writes: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.writer = threading.Thread(target=self._write_loop, daemon=True)
        self.writer.start()
        self.slot: _Slot = self.free.get()
        self.view = memoryview(self.slot.buf)
        self.fill = 0
        self.offset = 0  # file offset of the current buffer

    def _write_loop(self) -> None:
        while (item := self.writes.get()) is not None:
            slot, length, offset = item
            try:
                if self.error is None:
                    with memoryview(slot.buf) as view:
                        done = 0
                        while done < length:
                            done += os.pwrite(self.fd, view[done:length], offset + done)
            except BaseException as e:  # noqa: BLE001  (raised by the filling thread)
                self.error = e
            finally:
                slot.release()

    def _emit(self, last: bool = False) -> None:
        if self.error is not None:
            raise self.error
        n = self.fill
        if n == 0:
            return
        slot = self.slot
        if self.hasher is not None:
            slot.hold(2)
            self.hasher.feed(self.view[:n], done=slot.release)
        else:
            slot.hold(1)
        self.writes.put((slot, n + (-n % DIRECT_ALIGN), self.offset))
        self.offset += n
        self.view.release()
        if not last:
            self.slot = self.free.get()
            self.view = memoryview(self.slot.buf)
            self.fill = 0

    def put_bytes(self, data) -> None:
        src = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
        pos, n = 0, src.nbytes
        while pos < n:
            k = min(n - pos, DIRECT_BUFFER - self.fill)
            self.view[self.fill:self.fill + k] = src[pos:pos + k]
            self.fill += k
            pos += k
            if self.fill == DIRECT_BUFFER:
                self._emit()

    def put_range(self, rng: ByteRange) -> None:
        with open(rng.path, "rb") as f:
            pos, left = rng.start, rng.nbytes
            while left:
                k = min(left, DIRECT_BUFFER - self.fill)
                got = os.preadv(f.fileno(), [self.view[self.fill:self.fill + k]], pos)
                if got == 0:
                    raise ArtifactError(f"{rng.path.name}: ended early while copying bytes {rng.start}..")
                self.fill += got
                pos += got
                left -= got
                if self.fill == DIRECT_BUFFER:
                    self._emit()

    def close(self) -> None:
        """Write what is left, wait for the writer, cut the padding off; raise its error."""
        try:
            self._emit(last=True)
        finally:
            self.writes.put(None)
            self.writer.join()
            try:
                if self.error is None:
                    os.ftruncate(self.fd, self.offset)
            finally:
                os.close(self.fd)
        if self.error is not None:
            raise self.error


def _open_direct(path: Path, hasher: ShardHasher | None) -> _DirectStream | None:
    if not hasattr(os, "O_DIRECT") or os.environ.get("HYBRID_BUILD_NO_DIRECT_IO"):
        return None
    try:
        return _DirectStream(path, hasher)
    except OSError as e:  # e.g. tmpfs: EINVAL
        log.debug("O_DIRECT not available for %s (%s): buffered writes", path, e)
        return None


def _shard_is_complete(path: Path, plan: ShardPlan) -> bool:
    """A finished shard from an earlier, interrupted run: same header and same size."""
    if not path.exists() or path.stat().st_size != plan.total_bytes:
        return False
    head = plan.header_bytes()
    with open(path, "rb") as f:
        return f.read(len(head)) == head


def write_shard(plan: ShardPlan, out_dir: Path, resume: bool = False,
                progress: Callable[[int], None] | None = None, durable: bool = False,
                hasher: ShardHasher | None = None, direct_io: bool = False) -> Path:
    """Write one shard under a temporary name, check its size, then rename it into place.

    ``durable`` fsyncs the shard before the rename. Writers of many shards leave it off and call
    ``os.sync()`` once before writing their index (per-shard fsync serialises the disk writes and
    cost ~40% of the copy time in benchmarks/bench_io.py); a process killed mid-write never leaves
    a torn file under the final name either way. ``hasher`` receives every byte written; with it,
    the shard is written with ``O_DIRECT`` where the filesystem allows (``_DirectStream``), else
    copied ranges go through ``copy_file_range`` and are hashed from their source files.
    ``direct_io`` asks for ``O_DIRECT`` without a hasher too."""
    final = out_dir / plan.filename
    if resume and _shard_is_complete(final, plan):
        log.info("keeping complete shard %s", plan.filename)
        if hasher:
            hasher.feed_range(ByteRange(final, 0, plan.total_bytes))
        if progress:
            progress(plan.data_bytes)
        return final
    tmp = out_dir / (plan.filename + TMP_SUFFIX)
    try:
        direct = _open_direct(tmp, hasher) if hasher or direct_io else None
        if direct is not None:
            try:
                _stream_shard(plan, direct, progress)
            finally:
                direct.close()
            return _finish(plan, tmp, final, durable)
        with open(tmp, "wb") as out:
            _stream_shard(plan, _FileSink(out, hasher), progress)
            out.flush()
        return _finish(plan, tmp, final, durable)
    except OSError as e:  # the user sees one line: the shard that could not be written, none left half-written
        tmp.unlink(missing_ok=True)
        raise output_error(e, final, tmp) from None


class _FileSink:
    """Buffered writes: copied ranges go through ``copy_file_range`` and are hashed from their source."""

    def __init__(self, out, hasher: ShardHasher | None) -> None:
        self.out, self.hasher = out, hasher
        self.buf = bytearray(COPY_CHUNK) if getattr(os, "copy_file_range", None) is None else None

    def put_bytes(self, data) -> None:
        self.out.write(data)
        if self.hasher:
            self.hasher.feed(data)

    def put_range(self, rng: ByteRange) -> None:
        _copy_range(rng, self.out, self.buf)
        if self.hasher:
            self.hasher.feed_range(rng)


def _stream_shard(plan: ShardPlan, sink: _FileSink | _DirectStream,
                  progress: Callable[[int], None] | None) -> None:
    """Header, then every tensor's bytes in plan order, into ``sink``; sizes checked against the header."""
    sink.put_bytes(plan.header_bytes())
    for t in plan.tensors:
        if isinstance(t.source, ByteRange):
            if t.source.nbytes != t.nbytes:
                raise ArtifactError(f"{t.name}: source range has {t.source.nbytes} bytes, header says {t.nbytes}")
            if t.source.ready:
                t.source.ready()
            sink.put_range(t.source)
        else:
            written = 0
            for chunk in t.source():
                sink.put_bytes(chunk)
                written += len(chunk) if isinstance(chunk, (bytes, bytearray)) else chunk.nbytes
            if written != t.nbytes:
                raise ArtifactError(f"{t.name}: producer wrote {written} bytes, header says {t.nbytes}")
        if progress:
            progress(t.nbytes)


def _finish(plan: ShardPlan, tmp: Path, final: Path, durable: bool) -> Path:
    if durable:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if tmp.stat().st_size != plan.total_bytes:
        raise ArtifactError(f"{plan.filename}: wrote {tmp.stat().st_size} bytes, planned {plan.total_bytes}")
    os.replace(tmp, final)
    return final


def write_index(out_dir: Path, shards: list[ShardPlan], extra_metadata: dict | None = None) -> Path:
    """Write ``model.safetensors.index.json`` (atomically) for the shards marked ``in_index``,
    after flushing every shard to disk: the index is what marks the folder complete."""
    os.sync()
    weight_map = {t.name: s.filename for s in shards if s.in_index for t in s.tensors}
    meta = {"total_size": sum(s.data_bytes for s in shards if s.in_index)}
    meta.update(extra_metadata or {})
    index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    return write_text_atomic(out_dir / INDEX_NAME, json.dumps(index, indent=2) + "\n")


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """``data`` into ``path`` under a temporary name, renamed when whole: a reader sees the old file
    or the new one, never part of one. A failure (a full disk) removes the temporary file and names
    ``path``. The file's mode is the umask's, as every file this tool writes."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise output_error(e, path, tmp) from None
    return path


def copy_file_atomic(src: Path, dst: Path) -> Path:
    """``src`` copied to ``dst`` under a temporary name, renamed when whole; a failure removes the
    temporary file and names ``dst`` where the cause is the write (``output_error``)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + TMP_SUFFIX)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise output_error(e, dst, tmp) from None
    return dst


# causes that concern the file being written whichever path the error carries: shutil's copy names
# the file it read from (``src: No space left on device``), write(2) names none
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def output_error(e: OSError, final: Path, tmp: Path) -> OSError:
    """``e`` as the user should read it: naming ``final``, the output that could not be written,
    where it names no file, the temporary file, or has a write-side cause (full, over quota, too
    large, read-only); an error naming another file (a source that cannot be read) keeps its name."""
    if e.filename is None or os.fspath(e.filename) == os.fspath(tmp) or e.errno in WRITE_ERRNOS:
        return OSError(e.errno, e.strerror or str(e), str(final))
    return e


def write_text_atomic(path: Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))

