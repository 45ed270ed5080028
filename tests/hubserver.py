"""A standard-library Hub-compatible HTTP server on loopback, for tests that run the real hub client.

Serves plain folders laid out `<root>/<org>/<name>/<files>` (docs/compat.md §7):

- `GET /api/models/{org}/{name}/revision/{rev}`: `id`, `sha`, `siblings` (with `size`, `blobId` and, for LFS
  files, `lfs: {sha256, size, pointerSize}`);
- `GET /api/models/{org}/{name}/tree/{rev}[/{path}]`: a list of `{type, oid, size, path[, lfs]}`;
- `HEAD` / `GET /{org}/{name}/resolve/{rev}/{path}`: bytes with `X-Repo-Commit`, quoted `ETag`, `Content-Length`;
  as on the Hub, an LFS file's ETag (and `X-Linked-Etag`) is its sha256 and any other file's is its git blob
  id (sha1 of `blob <size>\0<bytes>`); `Range: bytes=N-` answers 206 with `Content-Range` (resumed downloads);
- files whose names end in `lfs_suffixes` (weights) are the LFS files;
- revisions: `main` and the commit sha, which is derived from file names and content hashes (stable);
- errors: 404 with `X-Error-Code` `RepoNotFound` / `RevisionNotFound` / `EntryNotFound`;
  `gated` repos answer 401 `X-Error-Code: GatedRepo`; `fail_status` makes every answer that status;
  `unresolvable` files are listed but answer `EntryNotFound` (a file that vanished between listing and fetch);
  `truncate_once` drops the next GET of a file after N bytes (an interrupted transfer, to test resume);
  `corrupt` serves a file with 4 KiB flipped at an offset while listing and headers keep the true size and
  hashes (a bad mirror or disk); `stall_after` sends N bytes of a file, then holds the connection until
  `release` is set (so a test can kill the client mid-transfer); `advertise_size` lists a file with a
  different size (a file too big for the disk, without writing one); `listing_sizes = False` is a mirror
  whose revision listing gives no sizes: a plain file keeps its `blobId`, an LFS file is listed by name only
  (its hash and size come from a HEAD request, a plain file's size from the download's Content-Length).

Every request is logged (method, path, Range header) so tests can assert what the client did.
It binds 127.0.0.1 only; sockets carry a timeout so a stuck client cannot hang a test.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

DRAFT_REPO = "zoo-test/tiny-draft"
TARGET_REPO = "zoo-test/tiny-target"
_DRAFT_CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "dflash_config": {"block_size": 8, "target_layer_ids": [1], "mask_token_id": 999},
}
DRAFT_FILES = {
    "config.json": json.dumps(_DRAFT_CONFIG).encode(),
    "model.safetensors": bytes(range(256)) * 64,  # 16 KiB
    "README.md": b"# tiny draft\n",
}
TARGET_FILES = {"config.json": b'{"model_type": "qwen3"}\n', "model.safetensors": b"\x01" * 4096}
SAMPLE_REPOS = {DRAFT_REPO: DRAFT_FILES, TARGET_REPO: TARGET_FILES}


@dataclass(frozen=True)
class Request:
    """One logged request."""

    method: str
    path: str
    range: str | None


def file_etag(data: bytes) -> str:
    """The sha256 of a file: the ETag (and blob name in the HF cache) of an LFS file."""
    return hashlib.sha256(data).hexdigest()


def git_blob_id(data: bytes) -> str:
    """Git's object id of a file: sha1 of `blob <size>\0` + bytes (the ETag of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The git-lfs pointer file that git stores for an LFS file."""
    head = "version https://git-lfs.github.com/spec/v1\n"
    return f"{head}oid sha256:{file_etag(data)}\nsize {len(data)}\n".encode()


def flip(data: bytes, offset: int, n: int = 4096) -> bytes:
    """`data` with `n` bytes from `offset` inverted (same size)."""
    bad = bytes(b ^ 0xFF for b in data[offset : offset + n])
    return data[:offset] + bad + data[offset + n :]


class HubServer:
    """Serve `root` over HTTP on 127.0.0.1; `start()` / `stop()`, or use as a context manager."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.fail_status: int | None = None
        self.gated: set[str] = set()
        self.unresolvable: set[str] = set()  # "org/name/path": listed, but resolve answers EntryNotFound
        self.truncate_once: dict[str, int] = {}  # "org/name/path" -> bytes sent before the next GET drops
        self.corrupt: dict[str, int] = {}  # "org/name/path" -> offset of 4 KiB served inverted
        self.stall_after: dict[str, int] = {}  # "org/name/path" -> bytes sent before holding the connection
        self.release = threading.Event()  # set to let stalled transfers end (they drop the connection)
        self.advertise_size: dict[str, int] = {}  # "org/name/path" -> size the listings claim
        self.listing_sizes = True  # False: the revision listing gives no sizes (a mirror)
        self.lfs_suffixes: tuple[str, ...] = (".safetensors", ".bin", ".gguf", ".pt")
        self._log: list[Request] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # lifecycle ---------------------------------------------------------------------------------
    def start(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = self._thread = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    # repos -------------------------------------------------------------------------------------
    def add_file(self, repo_id: str, path: str, data: bytes) -> Path:
        """Create (or overwrite) one file in a served repo; returns its path on disk."""
        target = self.root / repo_id / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return target

    def add_samples(self) -> HubServer:
        """Serve `SAMPLE_REPOS` (a tiny drafter with a loadable config.json, and a tiny target)."""
        for repo_id, files in SAMPLE_REPOS.items():
            for path, data in files.items():
                self.add_file(repo_id, path, data)
        return self

    def files(self, repo_id: str) -> dict[str, bytes]:
        """All files of a repo, by repo-relative posix path (sorted)."""
        base = self.root / repo_id
        found = sorted(p for p in base.rglob("*") if p.is_file())
        return {p.relative_to(base).as_posix(): p.read_bytes() for p in found}

    def is_lfs(self, path: str) -> bool:
        return path.endswith(self.lfs_suffixes)

    def etag(self, path: str, data: bytes) -> str:
        """The unquoted ETag of a file, which is also its blob name in the HF cache."""
        return file_etag(data) if self.is_lfs(path) else git_blob_id(data)

    def commit(self, repo_id: str) -> str:
        """The repo's current commit sha: a hash of its id, file names and contents (stable, unique per repo)."""
        digest = hashlib.sha1(repo_id.encode() + b"\n")
        for path, data in self.files(repo_id).items():
            digest.update(f"{path}\0{file_etag(data)}\n".encode())
        return digest.hexdigest()

    # request log -------------------------------------------------------------------------------
    def record(self, req: Request) -> None:
        with self._lock:
            self._log.append(req)

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._log)

    def reset_log(self) -> None:
        with self._lock:
            self._log.clear()

    def file_gets(self) -> list[Request]:
        """GET requests for file bytes (HEADs and API calls excluded)."""
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path]


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer  # set on the per-server subclass
    protocol_version = "HTTP/1.1"
    timeout = 10

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence stderr logging
        pass

    def do_HEAD(self) -> None:
        self._dispatch(body=False)

    def do_GET(self) -> None:
        self._dispatch(body=True)

    def _dispatch(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.record(Request(self.command, path, self.headers.get("Range")))
        if self.hub.fail_status:
            return self._error(self.hub.fail_status, "ServerError", "simulated failure")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            return self._api(parts[2] + "/" + parts[3], parts[4], parts[5:], body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), body)
        self._error(404, "RepoNotFound", "not found")

    def _check(self, repo_id: str, rev: str) -> bool:
        """Answer the repo / gated / revision errors; True when the request may proceed."""
        if not (self.hub.root / repo_id).is_dir():
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        elif repo_id in self.hub.gated:
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
        elif rev not in ("main", self.hub.commit(repo_id)):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        else:
            return True
        return False

    def _api(self, repo_id: str, kind: str, rest: list[str], body: bool) -> None:
        if kind not in ("revision", "tree"):
            return self._error(404, "RepoNotFound", "not found")
        if not self._check(repo_id, rest[0]):
            return
        files = self.hub.files(repo_id)
        if kind == "revision":
            siblings = [{"rfilename": p, **self._listed(repo_id, p, d)} for p, d in files.items()]
            doc: object = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": self.hub.commit(repo_id),
                "siblings": siblings,
            }
        else:
            prefix = "/".join(rest[1:])
            doc = [
                {"type": "file", "path": p, **self._meta(repo_id, p, d, "oid")}
                for p, d in files.items()
                if p.startswith(prefix)
            ]
        self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"}, body)

    def _listed(self, repo_id: str, path: str, data: bytes) -> dict[str, object]:
        """A revision listing's sibling fields; without sizes (a mirror), an LFS file has no `lfs` block (the
        client needs its size) and its `blobId` would be the pointer's, so only its name is listed."""
        meta = self._meta(repo_id, path, data, "blobId")
        if self.hub.listing_sizes:
            return meta
        return {} if self.hub.is_lfs(path) else {"blobId": meta["blobId"]}

    def _meta(self, repo_id: str, path: str, data: bytes, oid_key: str) -> dict[str, object]:
        """Size and hashes of a file as the Hub lists them (`lfs` only for LFS files)."""
        size = self.hub.advertise_size.get(f"{repo_id}/{path}", len(data))
        if not self.hub.is_lfs(path):
            return {"size": size, oid_key: git_blob_id(data)}
        pointer = lfs_pointer(data)
        lfs = {"sha256" if oid_key == "blobId" else "oid": file_etag(data), "size": size,
               "pointerSize": len(pointer)}  # fmt: skip
        return {"size": size, oid_key: git_blob_id(pointer), "lfs": lfs}

    def _resolve(self, repo_id: str, rev: str, path: str, body: bool) -> None:
        if not self._check(repo_id, rev):
            return
        data = self.hub.files(repo_id).get(path)
        if data is None or f"{repo_id}/{path}" in self.hub.unresolvable:
            return self._error(404, "EntryNotFound", f"{path} does not exist at {rev}")
        key = f"{repo_id}/{path}"
        etag = f'"{self.hub.etag(path, data)}"'
        headers = {"X-Repo-Commit": self.hub.commit(repo_id), "ETag": etag, "Accept-Ranges": "bytes"}
        if self.hub.is_lfs(path):
            headers |= {"X-Linked-Etag": etag, "X-Linked-Size": str(len(data))}
        if key in self.hub.corrupt:
            data = flip(data, self.hub.corrupt[key])
        start = _range_start(self.headers.get("Range"))
        cut = self.hub.truncate_once.pop(key, None) if body else None
        if cut is not None:
            return self._send(200, data, headers, body, cut=cut)
        stall = self.hub.stall_after.pop(key, None) if body else None
        if stall is not None:
            return self._send(200, data, headers, body, cut=stall, hold=self.hub.release)
        if start is None or start == 0:
            return self._send(200, data, headers, body)
        if start >= len(data):
            headers["Content-Range"] = f"bytes */{len(data)}"
            return self._send(416, b"", headers, body)
        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._send(206, data[start:], headers, body)

    def _error(self, status: int, code: str, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
        self._send(status, payload, headers, body=self.command != "HEAD")

    def _send(
        self,
        status: int,
        payload: bytes,
        headers: dict[str, str],
        body: bool,
        cut: int | None = None,
        hold: threading.Event | None = None,
    ) -> None:
        """Answer with `payload`; with `cut`, announce the full length but drop the connection after `cut` bytes
        (after `hold` is set, or 30 s, when given)."""
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload if cut is None else payload[:cut])
        if cut is not None:
            self.wfile.flush()
            if hold is not None:
                hold.wait(timeout=30)
            self.close_connection = True


def _range_start(header: str | None) -> int | None:
    """First byte of an open-ended `bytes=N-` range (the only form the hub client sends), else None."""
    if not header or not header.startswith("bytes="):
        return None
    first = header[len("bytes=") :].split(",")[0].split("-")[0].strip()
    return int(first) if first.isdigit() else None
