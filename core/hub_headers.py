"""A Hub repository read the way ``Checkpoint`` reads a folder, headers only: what `inspect` and `plan`
read of a Hub id, a few MB where the weights are tens of GB.

``HubFiles.open(repo_id, revision)`` asks the Hub once for the repository at ``revision``: its commit
and every file's size (``HfApi.repo_info(files_metadata=True)``). Everything else is read at that
commit, so a branch that moves meanwhile cannot mix two versions: the JSON files ``Checkpoint`` reads
(``config.json``, the index), whole, up to ``MAX_JSON_BYTES``; and each ``*.safetensors`` file's
header through huggingface_hub's own remote reader (``HfApi.parse_safetensors_file_metadata``: a
ranged GET of the first 100 kB, a second one for the rest of a larger header; it refuses a header
over 25 MB), ``WORKERS`` files at a time. Nothing is written to the Hub cache: `run` downloads the
snapshot whole (``snapshot_download``), and an offline command never meets a snapshot that holds
only headers.

A header from the Hub is checked as a local one is (``safetensors_io.header_from_json``): each
tensor's dtype, shape and span, no gap or overlap between tensors, none past the end of the file
(its size from the Hub's listing). The library does not return the header's length, so where the
data begins is read from the end: the data is taken to end the file, and the header must leave room
for its own JSON written compactly (as safetensors writes it, padded to 8 bytes). A data region cut
short is found so; bytes added after the last tensor are not (`run` reads every downloaded header
again, that check included). A Hub failure is one line (``hub_errors``); a file that is not
safetensors is a ``SourceError`` for that file, collected by ``Checkpoint`` as locally.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from .errors import SourceError
from .safetensors_io import TMP_SUFFIX, FileHeader, header_from_json

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 256 << 20  # the 122B's index is 12 MB; a checkpoint's JSON file beyond this is refused
WORKERS = 8  # headers read at once (huggingface_hub's own get_safetensors_metadata uses its thread map too)


class HubFiles:
    """One commit of a Hub repository: its files' sizes, and reads of its JSON files and headers."""

    root = None  # nothing of it is on this machine

    def __init__(self, api, repo_id: str, commit: str, sizes: dict[str, int | None]):
        self.api, self.repo_id, self.commit, self.sizes = api, repo_id, commit, sizes
        self.where = repo_id

    @classmethod
    def open(cls, repo_id: str, revision: str | None = None) -> HubFiles:
        from huggingface_hub import HfApi

        api = HfApi()
        with _hub_errors(repo_id, revision):
            info = api.repo_info(repo_id, revision=revision or "main", files_metadata=True)
        if not info.sha:
            raise SourceError(f"{repo_id}: the Hub named no commit for revision {revision or 'main'!r}")
        sizes = {s.rfilename: s.size for s in info.siblings or []}
        log.info("%s: commit %s, %d files", repo_id, info.sha, len(sizes))
        return cls(api, repo_id, info.sha, sizes)

    def name(self, file: str) -> str:
        return f"{self.repo_id}/{file}"

    def safetensors_files(self) -> list[str]:
        return sorted(f for f in self.sizes if "/" not in f and f.endswith(".safetensors")
                      and not f.endswith(TMP_SUFFIX))

    def read_json(self, file: str) -> bytes | None:
        if file not in self.sizes:
            return None
        size = self.sizes[file]
        too_big = SourceError(f"{self.name(file)}: over {MAX_JSON_BYTES:,} bytes, more than a checkpoint's JSON "
                              f"file is read up to")
        if size is not None and size > MAX_JSON_BYTES:
            raise too_big
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(self.repo_id, file, revision=self.commit, endpoint=self.api.endpoint)
        body = bytearray()
        with _hub_errors(self.repo_id, self.commit):
            with get_session().stream("GET", url, headers=build_hf_headers(token=self.api.token),
                                      timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
                if r.status_code >= 400:  # the library's message from at most ERROR_BODY_BYTES of the body
                    import httpx

                    head = bytearray()
                    for chunk in r.iter_bytes():
                        head += chunk
                        if len(head) >= ERROR_BODY_BYTES:
                            break
                    hf_raise_for_status(httpx.Response(r.status_code, headers=r.headers, request=r.request,
                                                       content=bytes(head[:ERROR_BODY_BYTES])))
                hf_raise_for_status(r)
                for chunk in r.iter_bytes():  # bounded whatever the listing said
                    body += chunk
                    if len(body) > MAX_JSON_BYTES:
                        raise too_big
        return bytes(body)

    def read_headers(self, files: list[str]) -> dict[str, FileHeader | SourceError]:
        if not files:
            return {}
        with ThreadPoolExecutor(max_workers=min(WORKERS, len(files)), thread_name_prefix="hub-header") as pool:
            try:
                return dict(zip(files, pool.map(self._header, files)))
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)  # a failure or a stop: no new request starts
                raise

    def _header(self, file: str) -> FileHeader | SourceError:
        from huggingface_hub.errors import SafetensorsParsingError

        size = self.sizes.get(file)
        if size is None:
            return SourceError(f"{file}: the Hub's listing gives no size for it")
        try:
            with _hub_errors(self.repo_id, self.commit):
                meta = self.api.parse_safetensors_file_metadata(self.repo_id, file, revision=self.commit)
        except SafetensorsParsingError as e:
            return SourceError(f"{file}: not a safetensors file ({_why(e)})")
        except (KeyError, TypeError, AttributeError, ValueError):  # JSON the library's parser did not expect
            return SourceError(f"{file}: not a safetensors file (header is not a JSON object of tensors)")
        header: dict = {name: {"dtype": t.dtype, "shape": t.shape, "data_offsets": list(t.data_offsets)}
                        for name, t in meta.tensors.items()}
        if meta.metadata:
            header["__metadata__"] = meta.metadata
        ends = [t.data_offsets[1] for t in meta.tensors.values()
                if len(t.data_offsets) == 2 and isinstance(t.data_offsets[1], int)]
        data_start = size - max(ends, default=0)  # the data is taken to end the file (see above)
        # the header cannot be shorter than its JSON written compactly (safetensors writes it so, padded
        # to 8 bytes): a file whose data region was cut short leaves it too little room
        least = 8 + len(json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode())
        if data_start < least:
            need = least + max(ends, default=0)
            return SourceError(f"{file}: truncated: its header and tensors need at least {need} bytes, "
                               f"the file has {size}")
        try:
            return header_from_json(Path(file), header, data_start, size)
        except SourceError as e:
            return e


# an error answer's body is read this far for its message: the Hub's are a few hundred bytes
ERROR_BODY_BYTES = 64 * 1024


def _why(exc: BaseException) -> str:
    """The library's reason, without its preamble (file, repo, revision) and its advice."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split("): ", 1)[-1].split(". ")[0]


@contextmanager
def _hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """A Hub failure inside the block as one line (``hub_errors.hub_error``)."""
    from .hub_errors import hub_error, hub_exceptions

    try:
        yield
    except hub_exceptions() as e:
        raise hub_error(e, repo_id, revision=revision) from None
