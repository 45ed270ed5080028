"""Everything that touches the Hugging Face Hub, behind a few functions with clear offline errors.

Models live in the standard HF cache (`HF_HOME` / `HF_HUB_CACHE`); the zoo invents no model cache.
Offline (`HF_HUB_OFFLINE=1`) calls always pass `local_files_only=True` (hub 1.x otherwise tries the network).

huggingface_hub reads `HF_ENDPOINT`, `HF_HUB_CACHE` and `HF_HUB_OFFLINE` once, at import. This module reads
them from `os.environ` at call time and passes `endpoint=` / `cache_dir=` explicitly, so a changed environment
(tests, a long-lived process) is honoured with hub 1.x and 2.x alike.

Pulling is two steps: `plan_pull` (one revision lookup: files, sizes, commit, what is cached) and
`download` (fetches only what is missing; resumable, since the client continues `.incomplete` blobs).
Removal is `plan_removal` + `execute_removal` over `scan_cache_dir().delete_revisions`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash_zoo.errors import NotFoundError, OfflineError, ZooError

log = logging.getLogger("dflash_zoo")
DEFAULT_ENDPOINT = "https://huggingface.co"
_SHA = re.compile(r"^[0-9a-f]{40}$")


class GatedRepoError(ZooError):
    """The repo needs an accepted licence and a token."""


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
    return Path(os.path.expanduser(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")))


def hub_cache_dir() -> Path:
    """The model cache: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`, else `<HF_HOME>/hub`."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(os.path.expandvars(os.path.expanduser(env))) if env else hf_home() / "hub"


def repo_cache_dir(repo_id: str) -> Path:
    """`<cache>/models--<org>--<name>`, whether or not it exists."""
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


@dataclass(frozen=True)
class RemoteFile:
    """One file of a planned pull; `cached` when it is already in the snapshot folder."""

    path: str
    size: int
    cached: bool


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
        return sum(f.size for f in self.files)

    @property
    def missing_bytes(self) -> int:
        return sum(f.size for f in self.files if not f.cached)

    @property
    def up_to_date(self) -> bool:
        return all(f.cached for f in self.files)

    @property
    def path(self) -> Path:
        return repo_cache_dir(self.repo_id) / "snapshots" / self.commit


@dataclass(frozen=True)
class PullResult:
    """A finished pull: the local snapshot folder and how many bytes came over the network."""

    repo_id: str
    revision: str
    commit: str
    path: Path
    downloaded_bytes: int
    up_to_date: bool


def snapshot(
    repo_id: str,
    revision: str | None = None,
    allow_patterns: list[str] | None = None,
    offline: bool | None = None,
) -> Path:
    """Local snapshot folder of `repo_id` at `revision`, downloading what is missing unless offline."""
    from huggingface_hub import snapshot_download

    offline = is_offline() if offline is None else offline
    with hub_errors(repo_id, revision, offline=offline):
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=allow_patterns,
            local_files_only=offline,
            cache_dir=str(hub_cache_dir()),
            endpoint=None if offline else hub_endpoint(),
        )
    return Path(path)


def plan_pull(
    repo_id: str,
    revision: str | None = None,
    allow_patterns: Sequence[str] | None = None,
    offline: bool | None = None,
    name: str | None = None,
) -> PullPlan:
    """List files, sizes and the commit of `repo_id@revision`, marking what is cached.

    Online: one `model_info(files_metadata=True)` call. Offline: the cache only (never the network); raises
    `OfflineError` naming what is missing and `dflash-zoo pull <name>` as the next step.
    """
    revision = revision or "main"
    patterns = tuple(allow_patterns) if allow_patterns else None
    if is_offline() if offline is None else offline:
        return _offline_plan(repo_id, revision, patterns, name or repo_id)
    from huggingface_hub import HfApi

    with hub_errors(repo_id, revision, offline=False):
        info = HfApi(endpoint=hub_endpoint()).model_info(repo_id, revision=revision, files_metadata=True)
    siblings = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    wanted = _filter(sorted(siblings), patterns)
    if patterns and not wanted:
        raise NotFoundError(f"no file matching {list(patterns)} in {repo_id} at {revision}")
    snap = repo_cache_dir(repo_id) / "snapshots" / str(info.sha)
    files = tuple(RemoteFile(p, siblings[p], (snap / p).is_file()) for p in wanted)
    return PullPlan(repo_id, revision, str(info.sha), files, patterns)


def download(plan: PullPlan, progress: bool = True) -> PullResult:
    """Fetch what `plan` marks missing (progress bars on stderr when `progress`); a no-op when up to date.

    Pins the download to `plan.commit` and records `refs/<revision>` so offline lookups of the name work.
    """
    if not plan.up_to_date:
        from huggingface_hub import snapshot_download

        log.info("downloading %s@%s (%d bytes)", plan.repo_id, plan.commit[:12], plan.missing_bytes)
        with hub_errors(plan.repo_id, plan.revision, offline=False), _progress_bars(progress):
            snapshot_download(
                plan.repo_id,
                revision=plan.commit,
                allow_patterns=list(plan.allow_patterns) if plan.allow_patterns else None,
                cache_dir=str(hub_cache_dir()),
                endpoint=hub_endpoint(),
            )
    _write_ref(plan.repo_id, plan.revision, plan.commit)
    return PullResult(
        plan.repo_id, plan.revision, plan.commit, plan.path, plan.missing_bytes, up_to_date=plan.up_to_date
    )


def _filter(paths: list[str], patterns: tuple[str, ...] | None) -> list[str]:
    from huggingface_hub.utils import filter_repo_objects

    return list(filter_repo_objects(paths, allow_patterns=list(patterns) if patterns else None))


def _offline_plan(repo_id: str, revision: str, patterns: tuple[str, ...] | None, name: str) -> PullPlan:
    """A plan from the cache alone; every listed file is cached, or `OfflineError` says what is missing."""
    storage = repo_cache_dir(repo_id)
    hint = f"run `dflash-zoo pull {name}` while online (unset HF_HUB_OFFLINE, drop --offline)"
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
    paths = (
        sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())
        if snap.is_dir()
        else []
    )
    wanted = _filter(paths, patterns)
    if not wanted:
        what = f"files matching {list(patterns)}" if patterns else "files"
        raise OfflineError(f"{repo_id} snapshot {commit[:12]} has no cached {what}; offline mode is on", hint)
    files = tuple(RemoteFile(p, (snap / p).stat().st_size, True) for p in wanted)
    return PullPlan(repo_id, revision, commit, files, patterns)


def _write_ref(repo_id: str, revision: str, commit: str) -> None:
    """Point `refs/<revision>` at `commit` (as the client does) unless `revision` is itself a sha."""
    if _SHA.match(revision):
        return
    ref = repo_cache_dir(repo_id) / "refs" / revision
    if not ref.is_file() or ref.read_text().strip() != commit:
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)


@contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Turn huggingface_hub's tqdm bars off for the block when not `enabled`, then restore them."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    change = not enabled and not are_progress_bars_disabled()
    if change:
        disable_progress_bars()
    try:
        yield
    finally:
        if change:
            enable_progress_bars()


@contextmanager
def hub_errors(repo_id: str, revision: str | None, offline: bool) -> Iterator[None]:
    """Translate huggingface_hub / transport exceptions into one-line `ZooError`s with a next step."""
    from huggingface_hub import errors as e

    rev = revision or "main"
    try:
        yield
    except e.GatedRepoError as exc:
        url = f"{hub_endpoint()}/{repo_id}"
        hint = f"run `hf auth login` (or set HF_TOKEN) and accept the licence at {url}"
        raise GatedRepoError(f"{repo_id} is gated and this token has no access", hint) from exc
    except e.RepositoryNotFoundError as exc:
        raise NotFoundError(
            f"no such repo: {repo_id}", hint="check the id, or `hf auth login` if private"
        ) from exc
    except e.RevisionNotFoundError as exc:
        raise NotFoundError(f"{repo_id} has no revision {rev!r}") from exc
    except e.RemoteEntryNotFoundError as exc:
        raise NotFoundError(f"a file of {repo_id} is missing at {rev!r}: {_url_tail(exc)}") from exc
    except (e.LocalEntryNotFoundError, e.OfflineModeIsEnabled) as exc:
        if offline or isinstance(exc, e.OfflineModeIsEnabled):
            raise OfflineError(
                f"{repo_id} is not in the local cache and offline mode is on",
                hint=f"run `dflash-zoo pull {repo_id}` while online",
            ) from exc
        raise HubUnavailableError(f"could not reach {hub_endpoint()} for {repo_id}", _RETRY) from exc
    except e.HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status is not None and status >= 500:
            raise HubUnavailableError(
                f"{hub_endpoint()} answered HTTP {status} for {repo_id}", _RETRY
            ) from exc
        raise ZooError(f"Hub request for {repo_id} failed: {str(exc).splitlines()[0]}") from exc
    except Exception as exc:
        if type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3"):
            raise HubUnavailableError(f"could not reach {hub_endpoint()}: {exc}", _RETRY) from exc
        raise


_RETRY = "check the network / HF_ENDPOINT and retry; set HF_HUB_OFFLINE=1 to use only the cache"


def _url_tail(exc: BaseException) -> str:
    """The repo-relative file name from a hub error's URL, or the error's first line."""
    url = str(getattr(getattr(exc, "response", None), "url", "") or "")
    return url.split("/resolve/", 1)[-1].split("/", 1)[-1] if "/resolve/" in url else str(exc).splitlines()[0]


@dataclass(frozen=True)
class CachedRevision:
    """One cached snapshot of a repo."""

    repo_id: str
    commit: str
    refs: tuple[str, ...]
    size_bytes: int
    path: Path


@dataclass(frozen=True)
class RemovalPlan:
    """Cached revisions that `execute_removal` deletes; `not_cached` lists asked-for repos with nothing cached."""

    revisions: tuple[CachedRevision, ...]
    not_cached: tuple[str, ...]
    expected_freed_bytes: int


def cached_revisions(repo_id: str) -> list[CachedRevision]:
    """All cached revisions of a model repo (empty when the cache or repo is absent); no network."""
    info = _scan()
    repos = [] if info is None else [r for r in info.repos if r.repo_id == repo_id and r.repo_type == "model"]
    return [
        CachedRevision(repo_id, r.commit_hash, tuple(sorted(r.refs)), r.size_on_disk, Path(r.snapshot_path))
        for repo in repos
        for r in sorted(repo.revisions, key=lambda r: r.commit_hash)
    ]


def plan_removal(repo_ids: Sequence[str]) -> RemovalPlan:
    """Every cached revision of `repo_ids`, with the bytes deleting them frees (shared blobs counted once)."""
    revisions = tuple(r for repo_id in dict.fromkeys(repo_ids) for r in cached_revisions(repo_id))
    missing = tuple(rid for rid in dict.fromkeys(repo_ids) if not any(r.repo_id == rid for r in revisions))
    freed = 0
    if revisions:
        freed = _scan().delete_revisions(*(r.commit for r in revisions)).expected_freed_size
    return RemovalPlan(revisions, missing, freed)


def execute_removal(plan: RemovalPlan) -> int:
    """Delete the planned revisions through `scan_cache_dir().delete_revisions(...)`; returns bytes freed."""
    if not plan.revisions:
        return 0
    strategy = _scan().delete_revisions(*(r.commit for r in plan.revisions))
    strategy.execute()
    log.info("removed %d revision(s), %d bytes", len(plan.revisions), strategy.expected_freed_size)
    return strategy.expected_freed_size


def _scan():
    """`scan_cache_dir` on the current cache folder, or None when the folder does not exist."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return None
