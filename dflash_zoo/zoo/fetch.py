"""Verified, resumable transfer of one file into the Hugging Face cache's `blobs/` folder (torch-free).

A blob is named by the hash the Hub gives for the file: the sha256 of an LFS file (its ETag, `X-Linked-Etag`,
or `lfs.sha256` in the repo listing) or the git blob id of any other file (sha1 of `blob <size>\\0<bytes>`).
`fetch_blob` downloads into `<blob>.incomplete`, hashes while it writes, and renames the file to its blob name
only when size and hash match, so a corrupt transfer never enters the cache. A size the listing did not give
is taken from the download (its Content-Length, else the bytes written); the hash is checked all the same.

Cross-process rules:
- `<blob>.incomplete` keeps the bytes of an interrupted transfer (a kill -9 included); the next `fetch_blob`,
  in any process, hashes them and continues with `Range: bytes=N-`. A resumed file that then fails its hash
  is fetched once more from byte 0 (the old bytes may have been bad).
- Every transfer holds `flock` on `<cache>/.locks/<repo folder>/<blob>.lock`, the lock file huggingface_hub
  takes for the same blob (its `filelock` is `flock` on Linux), so two downloaders of one blob never write at
  once; `is_locked` lets `rm` tell an orphaned partial file from a transfer in progress.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash_zoo.errors import ZooError

log = logging.getLogger("dflash_zoo")
PARTIAL_SUFFIX = ".incomplete"
_READ_CHUNK = 1 << 20
_MAX_ATTEMPTS = 8  # connections per file before giving up (a drop with progress resumes; see _download)


class IntegrityError(ZooError):
    """Downloaded or cached bytes do not match the hash the Hub publishes for the file."""


def digest_kind(digest: str) -> str:
    """ "sha256" for a 64-hex digest (LFS files), "git-sha1" for a 40-hex git blob id."""
    return "sha256" if len(digest) == 64 else "git-sha1"


def new_hasher(digest: str, size: int) -> Any:
    """A hashlib object that yields `digest` for good bytes (git blob ids hash a `blob <size>\\0` head)."""
    if len(digest) == 64:
        return hashlib.sha256()
    h = hashlib.sha1()
    h.update(b"blob %d\0" % size)
    return h


def hash_file(path: Path, digest: str, size: int | None = None) -> str:
    """The hex hash of `path` of the same kind as `digest` (`size` defaults to the file's size)."""
    size = path.stat().st_size if size is None else size
    h = new_hasher(digest, size)
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def blob_lock(lock_file: Path, label: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `lock_file`; says once on stderr (log) when another process holds it."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o664)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process downloading %s", label)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def is_locked(lock_file: Path) -> bool:
    """True when some process holds `lock_file` (a transfer of that blob is running)."""
    if not lock_file.is_file():
        return False
    fd = os.open(lock_file, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class _Partial:
    """The `.incomplete` file of one blob, with the running hash of the bytes it holds.

    `size` may be None until the download says it (`learn_size`); a git blob id hashes a `blob <size>` head
    first, so its hash waits for the size (sha256 runs from the first byte).
    """

    def __init__(self, path: Path, digest: str, size: int | None):
        self.path, self.digest, self.size = path, digest, size
        self.hasher = self._new_hasher()
        self.offset = self.received = 0  # received: bytes that came over the network
        if path.is_file() and (size is None or path.stat().st_size <= size):
            self.offset = path.stat().st_size
            self._hash_existing()
        else:
            self.restart()
        self.resumed_from = self.offset

    def _new_hasher(self) -> Any:
        if self.size is None and len(self.digest) != 64:
            return None
        return new_hasher(self.digest, self.size or 0)

    def _hash_existing(self) -> None:
        """Feed the bytes already in the file to a fresh hasher (none yet: nothing to do)."""
        if self.hasher is None:
            return
        with open(self.path, "rb") as fh:
            while chunk := fh.read(_READ_CHUNK):
                self.hasher.update(chunk)

    def learn_size(self, size: int) -> None:
        """The size the download announced, for a file the listing gave none for."""
        if self.size is not None:
            return
        self.size = size
        if self.hasher is None:
            self.hasher = self._new_hasher()
            self._hash_existing()

    def hexdigest(self) -> str:
        """The hash of the bytes written (a file whose size was never announced takes the bytes written)."""
        self.learn_size(self.offset)
        return self.hasher.hexdigest()

    def restart(self) -> None:
        self.path.write_bytes(b"")
        self.hasher = self._new_hasher()
        self.offset = 0

    def append(self, fh: Any, chunk: bytes) -> None:
        """Write all of `chunk` (an unbuffered write may take part of it, e.g. as the disk fills), then hash it."""
        view = memoryview(chunk)
        while view:
            view = view[fh.write(view) :]
        if self.hasher is not None:
            self.hasher.update(chunk)
        self.offset += len(chunk)
        self.received += len(chunk)


def fetch_blob(
    url: str,
    blob: Path,
    digest: str,
    size: int | None,
    label: str,
    headers: dict[str, str],
    lock_file: Path,
    progress: bool = False,
    replace: bool = False,
) -> int:
    """Download `url` into `blob`, verified against `digest`; returns the bytes received over the network.

    `size` None: the listing gave none; the download's Content-Length is used, else the bytes written.
    Returns 0 when the blob appeared meanwhile (another process fetched it) unless `replace`. Raises
    `IntegrityError` naming `label` when a complete transfer from byte 0 does not hash to `digest`; the
    partial file is then deleted and nothing is stored.
    """
    with blob_lock(lock_file, label):
        if blob.is_file() and not replace:
            return 0
        part = _Partial(blob.with_name(blob.name + PARTIAL_SUFFIX), digest, size)
        _download(url, part, headers, label, progress)
        if part.hexdigest() != digest and part.resumed_from:
            log.warning("%s: resumed bytes did not verify; fetching it again from the start", label)
            part.restart()
            part.resumed_from = 0
            _download(url, part, headers, label, progress)
        actual, stored = part.hexdigest(), _synced_size(part.path)  # hashed bytes, bytes on disk
        size = part.size
        if part.offset != size or stored != size or actual != digest:
            part.path.unlink(missing_ok=True)
            got = f"{stored} bytes" if stored != size else f"{digest_kind(digest)} {actual[:12]}"
            raise IntegrityError(
                f"{label} failed verification: expected {size} bytes with {digest_kind(digest)} "
                f"{digest[:12]}, got {got}; nothing was stored",
                hint="retry the pull; if it fails again the Hub or a proxy on the way serves corrupt bytes",
            )
        os.replace(part.path, blob)
        return part.received


def _synced_size(path: Path) -> int:
    """Flush `path` to disk and return its size there."""
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())
        return os.fstat(fh.fileno()).st_size


def _download(url: str, part: _Partial, headers: dict[str, str], label: str, progress: bool) -> None:
    """Stream the rest of the file into `part`; a dropped connection resumes with a Range request."""
    from huggingface_hub.utils import tqdm

    failures = 0
    with tqdm(total=part.size, initial=part.offset, unit="B", unit_scale=True, desc=label,
              disable=not progress) as bar:  # fmt: skip
        for attempt in range(1, _MAX_ATTEMPTS + 1):
            before = part.offset
            try:
                return _one_request(url, part, headers, bar)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise ZooError(
                        f"the disk filled up while writing {part.path} ({label}); the partial file is kept",
                        hint="free space there and pull again: the transfer resumes where it stopped",
                    ) from exc
                raise
            except Exception as exc:
                failures = 0 if part.offset > before else failures + 1
                if not _is_transport_error(exc) or failures >= 3 or attempt == _MAX_ATTEMPTS:
                    raise
                log.warning("%s: connection dropped at byte %d (%s); resuming", label, part.offset, exc)
                time.sleep(0.2 * failures)


def _one_request(url: str, part: _Partial, headers: dict[str, str], bar: Any) -> None:
    """One GET from `part.offset`; a server that ignores the Range (200) restarts the file from byte 0."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session, hf_raise_for_status

    request_headers = dict(headers)
    if part.offset:
        request_headers["Range"] = f"bytes={part.offset}-"
    with get_session().stream(
        "GET", url, headers=request_headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT, follow_redirects=True
    ) as response:
        if part.size is None and (announced := _announced_size(response)) is not None:
            part.learn_size(announced)
            bar.reset(total=announced)
            bar.update(part.offset)
        if response.status_code == 416 and part.offset == part.size:
            return  # everything was already there
        hf_raise_for_status(response)
        if part.offset and (response.status_code != 206 or _range_start(response) != part.offset):
            part.restart()
            bar.reset(total=part.size)
        with open(part.path, "ab", buffering=0) as fh:  # unbuffered: what arrived is on disk at a kill
            for chunk in response.iter_bytes():
                part.append(fh, chunk)
                bar.update(len(chunk))
                if part.size is not None and part.offset > part.size:
                    break  # more bytes than the listing said: verification fails below


def _announced_size(response: Any) -> int | None:
    """The whole file's size a response announces: the total of a 206's `Content-Range: bytes N-M/T` (or a
    416's `bytes */T`), or a 200's Content-Length (the file from byte 0); None when it announces none."""
    if response.status_code in (206, 416):
        total = response.headers.get("Content-Range", "").rpartition("/")[2].strip()
        return int(total) if total.isdigit() else None
    length = response.headers.get("Content-Length", "").strip()
    return int(length) if response.status_code == 200 and length.isdigit() else None


def _range_start(response: Any) -> int | None:
    """First byte of a 206 answer's `Content-Range: bytes N-M/T`, else None."""
    value = response.headers.get("Content-Range", "")
    first = value.removeprefix("bytes ").split("-", 1)[0].strip()
    return int(first) if first.isdigit() else None


def _is_transport_error(exc: BaseException) -> bool:
    """A dropped connection or timeout from the HTTP stack (httpx / httpx2 / httpcore), not an HTTP status."""
    return type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "h11")
