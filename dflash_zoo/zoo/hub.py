"""Everything that touches the Hugging Face Hub, behind a few functions with clear offline errors.

Models live in the standard HF cache (`HF_HOME` / `HF_HUB_CACHE`); the zoo invents no model cache.
Offline (`HF_HUB_OFFLINE=1`) calls always pass `local_files_only=True` (hub 1.x otherwise tries the network).

huggingface_hub reads `HF_ENDPOINT`, `HF_HUB_CACHE` and `HF_HUB_OFFLINE` once, at import. This module reads
them from `os.environ` at call time and passes `endpoint=` / `cache_dir=` explicitly, so a changed environment
(tests, a long-lived process) is honoured with hub 1.x and 2.x alike.

Pulling is two steps: `plan_pull` (one revision lookup: files, sizes, hashes, commit, what is cached) and
`download` (fetches only what is missing, through `fetch.fetch_blob`: every file is verified against the Hub's
sha256 / git blob id before it enters `blobs/`, and interrupted transfers resume across processes). The
snapshot links are made only after every file verified, so a failed pull adds nothing to the snapshot.
`verify` re-hashes cached files. Free-space and writability checks are in `storage`; removal in `removal`.

Longer than the ~300 lines we aim for: planning, offline resolution and the verified download path of the Hub client share their types.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash_zoo.errors import InvalidArgumentError, NotFoundError, OfflineError, ZooError
from dflash_zoo.zoo import fetch
from dflash_zoo.zoo.storage import DiskSpaceError, ensure_writable, free_space_check  # noqa: F401  (re-exported)

log = logging.getLogger("dflash_zoo")
DEFAULT_ENDPOINT = "https://huggingface.co"
_SHA = re.compile(r"^[0-9a-f]{40}$")
_DIGEST = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")
# cached files up to this size are re-hashed on every pull (configs, tokenizers: milliseconds); bigger ones
# (weights) only with `pull --verify`, since they were verified when they were downloaded
ALWAYS_VERIFY_BYTES = 32 * 2**20


class GatedRepoError(ZooError):
    """The repo needs an accepted license and a token."""


class HubUnavailableError(ZooError):
    """The Hub could not be reached or answered with a server error (5xx)."""


def is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def hub_endpoint() -> str:
    """The Hub base URL: `HF_ENDPOINT` at call time, else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hf_home() -> Path:
    """`HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface` (huggingface_hub's rule)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(
        os.path.expandvars(os.path.expanduser(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")))
    )


def hub_cache_dir() -> Path:
    """The model cache: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`, else `<HF_HOME>/hub`."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(os.path.expandvars(os.path.expanduser(env))) if env else hf_home() / "hub"


def cache_env_var() -> str:
    """The variable that chose `hub_cache_dir()`, for error messages."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        if os.environ.get(var):
            return var
    return "HF_HOME unset, so the default"


def repo_cache_dir(repo_id: str) -> Path:
    """`<cache>/models--<org>--<name>`, whether or not it exists."""
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def lock_file(repo_id: str, blob_name: str) -> Path:
    """The per-blob lock huggingface_hub also takes: `<cache>/.locks/models--<org>--<name>/<blob>.lock`."""
    return hub_cache_dir() / ".locks" / repo_cache_dir(repo_id).name / f"{blob_name}.lock"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a planned pull; `cached` when it is in the snapshot folder.

    `digest` is the hash the Hub publishes (sha256 for LFS files, the git blob id otherwise) and the blob's
    name in the cache; None when the listing gave none (a HEAD request's ETag gives it before the download).
    `size` is None when the listing gave none (a mirror that lists names only): the download's
    Content-Length (or the bytes written) gives it, and the hash is still verified.
    """

    path: str
    size: int | None
    cached: bool
    digest: str | None = None


@dataclass(frozen=True)
class PullPlan:
    """What `download` will fetch: `commit` is the 40-hex sha `revision` resolved to."""

    repo_id: str
    revision: str
    commit: str
    files: tuple[RemoteFile, ...]
    allow_patterns: tuple[str, ...] | None = None

    @property
    def total_bytes(self) -> int:
        """Bytes of the files whose size is known (`unknown_sizes` counts the others)."""
        return sum(f.size or 0 for f in self.files)

    @property
    def missing_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files if not f.cached)

    @property
    def unknown_sizes(self) -> int:
        """Files to download whose size the listing did not give."""
        return sum(f.size is None and not f.cached for f in self.files)

    @property
    def up_to_date(self) -> bool:
        return all(f.cached for f in self.files)

    @property
    def path(self) -> Path:
        return repo_cache_dir(self.repo_id) / "snapshots" / self.commit


@dataclass(frozen=True)
class PullResult:
    """A finished pull: the snapshot folder and the bytes that really came over the network."""

    repo_id: str
    revision: str
    commit: str
    path: Path
    downloaded_bytes: int
    up_to_date: bool
    fetched: tuple[str, ...] = ()


@dataclass(frozen=True)
class CorruptFile:
    """A cached file whose bytes do not hash to the digest it is stored under."""

    repo_id: str
    path: str
    expected: str
    actual: str


def snapshot(
    repo_id: str,
    revision: str | None = None,
    allow_patterns: list[str] | None = None,
    offline: bool | None = None,
) -> Path:
    """Snapshot folder of `repo_id` at `revision`, downloading (verified) what is missing unless offline."""
    offline = is_offline() if offline is None else offline
    if not offline:
        try:
            plan = plan_pull(repo_id, revision, allow_patterns, offline=False)
        except HubUnavailableError as exc:
            try:  # as huggingface_hub does: an unreachable Hub falls back to a complete cached snapshot
                path = _offline_plan(repo_id, revision or "main", _patterns(allow_patterns), repo_id).path
            except OfflineError:
                raise exc from None
            log.warning("%s; using the cached snapshot %s", exc, path)
            return path
        return download(plan, progress=sys.stderr.isatty()).path
    from huggingface_hub import snapshot_download

    with hub_errors(repo_id, revision, offline=True):
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=allow_patterns,
            local_files_only=True,
            cache_dir=str(hub_cache_dir()),
        )
    return Path(path)


def plan_pull(
    repo_id: str,
    revision: str | None = None,
    allow_patterns: Sequence[str] | None = None,
    offline: bool | None = None,
    name: str | None = None,
) -> PullPlan:
    """List files, sizes, hashes and the commit of `repo_id@revision`, marking what is cached.

    Online: one `model_info(files_metadata=True)` call. Offline: the cache only (never the network); raises
    `OfflineError` naming what is missing and `dflash-zoo pull <name>` as the next step.
    """
    revision = revision or "main"
    patterns = _patterns(allow_patterns)
    if is_offline() if offline is None else offline:
        return _offline_plan(repo_id, revision, patterns, name or repo_id)
    from huggingface_hub import HfApi

    with hub_errors(repo_id, revision, offline=False):
        info = HfApi(endpoint=hub_endpoint()).model_info(repo_id, revision=revision, files_metadata=True)
    siblings = {s.rfilename: s for s in info.siblings or []}
    wanted = _filter(sorted(siblings), patterns)
    if patterns and not wanted:
        raise NotFoundError(f"no file matching {list(patterns)} in {repo_id} at {revision}")
    snap = repo_cache_dir(repo_id) / "snapshots" / str(info.sha)
    files = tuple(
        RemoteFile(p, _listed_size(siblings[p], snap / p), (snap / p).is_file(), _sibling_digest(siblings[p]))
        for p in wanted
    )
    return PullPlan(repo_id, revision, str(info.sha), files, patterns)


def _listed_size(sibling: object, cached: Path) -> int | None:
    """The listed size; else the cached file's; None when neither is known (taken from the download)."""
    size = getattr(sibling, "size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return size
    return cached.stat().st_size if cached.is_file() else None


def _patterns(allow_patterns: Sequence[str] | None) -> tuple[str, ...] | None:
    return tuple(allow_patterns) if allow_patterns else None


def _sibling_digest(sibling: object) -> str | None:
    """The Hub's hash of a listed file: `lfs.sha256` for LFS files, else the git blob id."""
    lfs = getattr(sibling, "lfs", None)
    digest = (getattr(lfs, "sha256", None) if lfs else None) or getattr(sibling, "blob_id", None)
    return digest.lower() if isinstance(digest, str) and _DIGEST.match(digest.lower()) else None


def verify(plan: PullPlan, everything: bool = False) -> list[CorruptFile]:
    """Re-hash the cached files of `plan` (all when `everything`, else those up to `ALWAYS_VERIFY_BYTES`)."""
    bad = []
    for f in plan.files:
        if not f.cached or not (everything or (f.size or 0) <= ALWAYS_VERIFY_BYTES):
            continue
        expected = f.digest or _linked_digest(plan.path / f.path)
        if expected is None:
            continue  # a copied file (no blob link) of an offline plan: nothing to compare with
        actual = fetch.hash_file(plan.path / f.path, expected)
        if actual != expected:
            bad.append(CorruptFile(plan.repo_id, f.path, expected, actual))
    return bad


def _linked_digest(pointer: Path) -> str | None:
    """The blob name a snapshot symlink points at, when it is a hash (the HF cache names blobs by ETag)."""
    if not pointer.is_symlink():
        return None
    name = os.path.basename(os.readlink(pointer))
    return name if _DIGEST.match(name) else None


def bytes_to_fetch(plan: PullPlan, refetch: Collection[str] = ()) -> int:
    """Bytes `download(plan, refetch=...)` still has to transfer (partial files already on disk count)."""
    blobs = repo_cache_dir(plan.repo_id) / "blobs"
    total = 0
    for f in _to_fetch(plan, refetch):
        part = blobs / f"{f.digest}{fetch.PARTIAL_SUFFIX}" if f.digest else None
        have = part.stat().st_size if part is not None and part.is_file() else 0
        total += max((f.size or 0) - have, 0)  # an unknown size is learnt when the download starts
    return total


def check_space(need: int, repo_ids: Sequence[str]) -> None:
    """Raise `DiskSpaceError` naming the cache folder when it has less than `need` bytes free."""
    free_space_check(need, hub_cache_dir(), ", ".join(repo_ids), cache_env_var())


def download(plan: PullPlan, progress: bool = True, refetch: Collection[str] = ()) -> PullResult:
    """Fetch what `plan` marks missing, plus the cached files named in `refetch` (re-downloaded, verified).

    Checks that the cache is writable and has room first. Files land in `blobs/` verified, and the snapshot
    links are made once all of them are there. Records `refs/<revision>` so offline lookups of the name work.
    """
    todo = _to_fetch(plan, refetch)
    received = 0
    if todo:
        ensure_writable(hub_cache_dir(), "the Hugging Face cache", cache_env_var())
        check_space(bytes_to_fetch(plan, refetch), [plan.repo_id])
        log.info("downloading %s@%s (%d files)", plan.repo_id, plan.commit[:12], len(todo))
        with hub_errors(plan.repo_id, plan.revision, offline=False):
            fetched = {f.path: _fetch_one(plan, f, progress, f.path in refetch) for f in todo}
        received = sum(n for n, _ in fetched.values())
        for f in todo:
            _link(plan, f, fetched[f.path][1])
    _write_ref(plan.repo_id, plan.revision, plan.commit)
    return PullResult(plan.repo_id, plan.revision, plan.commit, plan.path, received,
                      up_to_date=not todo, fetched=tuple(f.path for f in todo))  # fmt: skip


def _to_fetch(plan: PullPlan, refetch: Collection[str]) -> list[RemoteFile]:
    return [f for f in plan.files if not f.cached or f.path in refetch]


def _fetch_one(plan: PullPlan, f: RemoteFile, progress: bool, replace: bool) -> tuple[int, str]:
    """Fetch one file into `blobs/<digest>` (verified); the digest is the listing's, or a HEAD's ETag.

    Returns (bytes received, the digest it is stored under)."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(plan.repo_id, f.path, revision=plan.commit, endpoint=hub_endpoint())
    headers = build_hf_headers()
    digest, size = (f.digest, f.size) if f.digest else _head_meta(url, headers, f.path, f.size)
    label = f"{f.path} of {plan.repo_id}@{plan.commit[:12]}"
    blob = repo_cache_dir(plan.repo_id) / "blobs" / digest
    blob.parent.mkdir(parents=True, exist_ok=True)
    got = fetch.fetch_blob(url, blob, digest, size, label, headers, lock_file(plan.repo_id, digest),
                           progress=progress, replace=replace)  # fmt: skip
    return got, digest


def _head_meta(url: str, headers: dict[str, str], path: str, size: int | None) -> tuple[str, int | None]:
    """(ETag, size) of a file the listing gave no hash for, from a HEAD request; only a sha256 or git blob
    id can be verified. The size stays the listing's when it gave one, else the HEAD's (None if neither)."""
    from huggingface_hub import get_hf_file_metadata

    meta = get_hf_file_metadata(url, headers=headers)
    etag = (meta.etag or "").lower()
    if not _DIGEST.match(etag):
        raise fetch.IntegrityError(
            f"the Hub gives no sha256 or git blob id for {path} (ETag {etag!r}): it cannot be verified",
            hint="the endpoint (HF_ENDPOINT) is not a Hub that publishes file hashes",
        )
    return etag, size if size is not None else meta.size


def _link(plan: PullPlan, f: RemoteFile, digest: str | None = None) -> None:
    """Point `snapshots/<commit>/<path>` at its blob with a relative symlink (swapped in atomically)."""
    pointer = plan.path / f.path
    digest = digest or f.digest or _linked_digest(pointer)
    if digest is None:
        return
    blob = repo_cache_dir(plan.repo_id) / "blobs" / digest
    target = os.path.relpath(blob, pointer.parent)
    if pointer.is_symlink() and os.readlink(pointer) == target:
        return
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, pointer)


def _filter(paths: list[str], patterns: tuple[str, ...] | None) -> list[str]:
    from huggingface_hub.utils import filter_repo_objects

    return list(filter_repo_objects(paths, allow_patterns=list(patterns) if patterns else None))


def _offline_plan(repo_id: str, revision: str, patterns: tuple[str, ...] | None, name: str) -> PullPlan:
    """A plan from the cache alone; every listed file is cached, or `OfflineError` says what is missing."""
    storage = repo_cache_dir(repo_id)
    hint = f"run `dflash-zoo pull {name}` while online (with HF_HUB_OFFLINE unset)"
    ref = storage / "refs" / revision
    if not storage.is_dir():
        raise OfflineError(
            f"{repo_id} is not in the local cache ({hub_cache_dir()}) and offline mode is on", hint
        )
    if not _SHA.match(revision) and not ref.is_file():
        raise OfflineError(
            f"{repo_id} has no cached revision {revision!r} (no {ref}); offline mode is on", hint
        )
    commit = revision if _SHA.match(revision) else ref.read_text().strip()
    snap = storage / "snapshots" / commit
    entries = [p for p in snap.rglob("*") if p.is_file() or p.is_symlink()] if snap.is_dir() else []
    paths = sorted(p.relative_to(snap).as_posix() for p in entries)
    wanted = _filter(paths, patterns)
    if not wanted:
        what = f"files matching {list(patterns)}" if patterns else "files"
        raise OfflineError(f"{repo_id} snapshot {commit[:12]} has no cached {what}; offline mode is on", hint)
    gone = [p for p in wanted if not (snap / p).is_file()]  # a link whose blob was deleted
    if gone:
        raise OfflineError(
            f"{repo_id} snapshot {commit[:12]} lists {', '.join(gone)} but its data is gone from the cache "
            "(a link to a deleted blob); offline mode is on",
            hint,
        )
    files = tuple(RemoteFile(p, (snap / p).stat().st_size, True, _linked_digest(snap / p)) for p in wanted)
    return PullPlan(repo_id, revision, commit, files, patterns)


def _write_ref(repo_id: str, revision: str, commit: str) -> None:
    """Point `refs/<revision>` at `commit` (as the client does) unless `revision` is itself a sha."""
    if _SHA.match(revision):
        return
    ref = repo_cache_dir(repo_id) / "refs" / revision
    if not ref.is_file() or ref.read_text().strip() != commit:
        try:
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(commit)
        except OSError as exc:  # best effort, as in huggingface_hub: a read-only cache still serves files
            log.warning("could not record %s -> %s in %s: %s", revision, commit[:12], ref, exc)


@contextmanager
def hub_errors(repo_id: str, revision: str | None, offline: bool) -> Iterator[None]:
    """Translate huggingface_hub / transport exceptions into one-line `ZooError`s with a next step."""
    from huggingface_hub import errors as e

    rev = revision or "main"
    try:
        yield
    except e.GatedRepoError as exc:
        url = f"{hub_endpoint()}/{repo_id}"
        hint = f"run `hf auth login` (or set HF_TOKEN) and accept the license at {url}"
        raise GatedRepoError(f"{repo_id} is gated and this token has no access", hint) from exc
    except e.RepositoryNotFoundError as exc:
        raise NotFoundError(
            f"no such repo: {repo_id}", hint="check the id, or `hf auth login` if private"
        ) from exc
    except e.RevisionNotFoundError as exc:
        raise NotFoundError(
            f"{repo_id} has no revision {rev!r}",
            hint=f"check the branch, tag or commit; {hub_endpoint()}/{repo_id}/commits/main lists them",
        ) from exc
    except e.RemoteEntryNotFoundError as exc:
        raise NotFoundError(
            f"a file of {repo_id} is missing at {rev!r}: {_url_tail(exc)}",
            hint="the repo changed while it was read: pull again",
        ) from exc
    except (e.LocalEntryNotFoundError, e.OfflineModeIsEnabled) as exc:
        if offline or isinstance(exc, e.OfflineModeIsEnabled):
            raise OfflineError(
                f"{repo_id} is not in the local cache and offline mode is on",
                hint=f"run `dflash-zoo pull {repo_id}` while online",
            ) from exc
        raise HubUnavailableError(f"could not reach {hub_endpoint()} for {repo_id}", _RETRY) from exc
    except e.HFValidationError as exc:  # the id itself is malformed: nothing was asked of the Hub
        raise InvalidArgumentError(
            f"{repo_id!r} is not a valid Hub repo id: {str(exc).splitlines()[0]}",
            hint="a repo id is `org/name`: letters, digits, '-', '_' and '.', without '--' or '..'",
        ) from exc
    except e.HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status is not None and status >= 500:
            raise HubUnavailableError(
                f"{hub_endpoint()} answered HTTP {status} for {repo_id}", _RETRY
            ) from exc
        raise ZooError(
            f"Hub request for {repo_id} failed: {str(exc).splitlines()[0]}",
            hint="check the repo id and your token (`hf auth login`), then retry",
        ) from exc
    except Exception as exc:
        if type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3"):
            raise HubUnavailableError(f"could not reach {hub_endpoint()}: {exc}", _RETRY) from exc
        raise


_RETRY = "check the network / HF_ENDPOINT and retry; set HF_HUB_OFFLINE=1 to use only the cache"


def _url_tail(exc: BaseException) -> str:
    """The repo-relative file name from a hub error's URL, or the error's first line."""
    url = str(getattr(getattr(exc, "response", None), "url", "") or "")
    return url.split("/resolve/", 1)[-1].split("/", 1)[-1] if "/resolve/" in url else str(exc).splitlines()[0]
