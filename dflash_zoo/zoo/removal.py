"""Removing repos from the Hugging Face cache, with the bytes that really go (torch-free).

`rm` removes every cached revision of a repo, so the whole `models--<org>--<name>` folder goes: snapshots,
refs, blobs, and the `.incomplete` files interrupted downloads left in `blobs/`. The bytes reported are those
of the regular files deleted (blobs, partial files), each inode counted once; snapshot symlinks are not
counted, since they point at blobs. A partial file whose per-blob lock is held belongs to a download in
progress: the repo is then refused, not half-deleted.

Nothing the Hub client did not write is destroyed: a regular file outside `blobs/`, `refs/` and `.no_exist/`
(a user's own file put in a snapshot) is kept in place with the folders above it, and listed; a link is
unlinked, never followed, so a repo folder that is itself a link to another disk loses only the link.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash_zoo.errors import ZooError
from dflash_zoo.zoo import fetch
from dflash_zoo.zoo.hub import cache_env_var, hub_cache_dir, lock_file, repo_cache_dir
from dflash_zoo.zoo.storage import DiskSpaceError, ensure_writable

log = logging.getLogger("dflash_zoo")


@dataclass(frozen=True)
class CachedRevision:
    """One cached snapshot of a repo; `size_bytes` counts the distinct blobs (and copies) it references."""

    repo_id: str
    commit: str
    refs: tuple[str, ...]
    size_bytes: int
    path: Path


@dataclass(frozen=True)
class PartialFile:
    """An `.incomplete` file in `blobs/`; `in_use` when a download holds its lock right now."""

    path: Path
    size: int
    in_use: bool


@dataclass(frozen=True)
class RepoRemoval:
    """Everything `rm` deletes for one repo: its folder, with `size_bytes` of regular files in it."""

    repo_id: str
    folder: Path
    revisions: tuple[CachedRevision, ...]
    partials: tuple[PartialFile, ...]
    size_bytes: int
    kept: tuple[Path, ...] = ()  # regular files the Hub client did not write: left in place
    linked_to: Path | None = None  # the folder is a link to this folder: only the link is removed


@dataclass(frozen=True)
class RemovalPlan:
    """What `execute_removal` deletes; `not_cached` lists asked-for repos with nothing in the cache."""

    repos: tuple[RepoRemoval, ...]
    not_cached: tuple[str, ...]

    @property
    def revisions(self) -> tuple[CachedRevision, ...]:
        return tuple(r for repo in self.repos for r in repo.revisions)

    @property
    def partials(self) -> tuple[PartialFile, ...]:
        return tuple(p for repo in self.repos for p in repo.partials)

    @property
    def expected_freed_bytes(self) -> int:
        return sum(repo.size_bytes for repo in self.repos)


def cached_revisions(repo_id: str) -> list[CachedRevision]:
    """All cached revisions of a model repo (empty when the cache or repo is absent); no network."""
    folder = repo_cache_dir(repo_id)
    snaps = folder / "snapshots"
    if not snaps.is_dir():
        return []
    refs = _refs(folder / "refs")
    revisions = []
    for d in sorted(p for p in snaps.iterdir() if p.is_dir()):
        names = tuple(sorted(n for n, commit in refs.items() if commit == d.name))
        revisions.append(CachedRevision(repo_id, d.name, names, _tree_bytes(d), d))
    return revisions


def plan_removal(repo_ids: Sequence[str]) -> RemovalPlan:
    """What removing `repo_ids` from the cache deletes (nothing is touched)."""
    repos, missing = [], []
    for repo_id in dict.fromkeys(repo_ids):
        folder = repo_cache_dir(repo_id)
        if not folder.is_dir():
            missing.append(repo_id)
            continue
        revisions, partials = tuple(cached_revisions(repo_id)), _partials(repo_id)
        if folder.is_symlink():  # moved elsewhere by the user and linked back: nothing there is deleted
            repos.append(RepoRemoval(repo_id, folder, revisions, partials, 0, linked_to=folder.resolve()))
            continue
        kept = _not_from_hub(folder)
        size = _tree_bytes(folder, follow=False, skip=set(kept))
        repos.append(RepoRemoval(repo_id, folder, revisions, partials, size, kept))
    return RemovalPlan(tuple(repos), tuple(missing))


def check_removable(plan: RemovalPlan) -> None:
    """Raise when a download of a planned repo is running, or the cache is read-only (nothing is touched)."""
    for repo in plan.repos:
        busy = [p.path.name for p in _partials(repo.repo_id) if p.in_use]
        if busy:
            raise ZooError(
                f"{repo.repo_id} is being downloaded by another process ({', '.join(busy)}); "
                "nothing was removed",
                hint="wait for that pull to finish (or stop it), then run `dflash-zoo rm` again",
            )
    if plan.repos:
        ensure_writable(hub_cache_dir(), "the Hugging Face cache", cache_env_var())


def execute_removal(plan: RemovalPlan) -> int:
    """Delete the planned repo folders; returns the bytes of the regular files actually removed.

    Refuses (before deleting anything) when `check_removable` does.
    """
    check_removable(plan)
    freed = 0
    for repo in plan.repos:
        try:
            if repo.linked_to:
                os.unlink(repo.folder)  # the link only: what it points at is not the cache's
            else:
                freed += _remove_tree(repo.folder, set(repo.kept))
        except OSError as exc:
            raise DiskSpaceError(
                f"cannot remove {repo.folder} ({cache_env_var()}): {exc.strerror or exc}",
                hint="make the cache writable, then run `dflash-zoo rm` again",
            ) from exc
        locks = hub_cache_dir() / ".locks" / repo.folder.name
        shutil.rmtree(locks, ignore_errors=True)  # empty lock files of this repo's blobs
    log.info("removed %d repo folder(s), %d bytes", len(plan.repos), freed)
    return freed


def _refs(refs_dir: Path) -> dict[str, str]:
    """{ref name: commit}; names may be nested (`refs/pr/1`)."""
    if not refs_dir.is_dir():
        return {}
    found = {}
    for path in refs_dir.rglob("*"):
        if path.is_file():
            found[path.relative_to(refs_dir).as_posix()] = path.read_text().strip()
    return found


def _partials(repo_id: str) -> tuple[PartialFile, ...]:
    """Partial files in `blobs/`: ours (`<blob>.incomplete`) and the client's (`<blob>.<id>.incomplete`)."""
    blobs = repo_cache_dir(repo_id) / "blobs"
    if not blobs.is_dir():
        return ()
    found = sorted(p for p in blobs.iterdir() if p.name.endswith(fetch.PARTIAL_SUFFIX) and p.is_file())
    return tuple(
        PartialFile(p, p.stat().st_size, fetch.is_locked(lock_file(repo_id, p.name.split(".")[0])))
        for p in found
    )


def _not_from_hub(folder: Path) -> tuple[Path, ...]:
    """Regular files (not links) under a repo folder outside `blobs/`, `refs/` and `.no_exist/`: the Hub
    client writes none there, so they are a user's own."""
    found = []
    for dirpath, dirs, names in os.walk(folder):
        if Path(dirpath) == folder:
            dirs[:] = [d for d in dirs if d not in ("blobs", "refs", ".no_exist")]
        found += [p for n in names if stat.S_ISREG(os.lstat(p := Path(dirpath) / n).st_mode)]
    return tuple(sorted(found))


def _tree_bytes(root: Path, follow: bool = True, skip: set[Path] | None = None) -> int:
    """Bytes of the distinct regular files under `root` but `skip`; `follow`: through snapshot symlinks to
    their blobs (a revision's size), else the files in `root` only, which are what `_remove_tree` deletes (a
    link to a file elsewhere is unlinked, its file kept and not counted)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if skip and Path(dirpath) / name in skip:
                continue
            try:
                st = os.stat(os.path.join(dirpath, name), follow_symlinks=follow)
            except OSError:
                continue  # a dangling link
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _remove_tree(root: Path, keep: set[Path]) -> int:
    """Delete `root` bottom-up but the files in `keep` (and the folders holding them); returns the bytes of
    the regular files unlinked (each inode once)."""
    holding = {parent for path in keep for parent in path.parents}  # folders that must stay
    seen: set[tuple[int, int]] = set()
    freed = 0
    for dirpath, dirs, names in os.walk(root, topdown=False):
        for name in names:
            path = Path(dirpath) / name
            if path in keep:
                continue
            st = os.lstat(path)  # a symlink's own stat: links are not counted
            os.unlink(path)
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                freed += st.st_size
        for name in dirs:
            path = Path(dirpath) / name
            if path.is_symlink():
                os.unlink(path)
            elif path not in holding:
                os.rmdir(path)
    if root not in holding:
        os.rmdir(root)
    return freed
