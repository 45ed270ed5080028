"""Checks before writing: enough free disk space, and folders that can be written (torch-free).

Both fail with one line naming the folder (and the environment variable that chose it) before any byte is
downloaded, instead of an `OSError` from deep inside a transfer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dflash_zoo.errors import ZooError

__all__ = ["DiskSpaceError", "ensure_writable", "free_space_check"]


class DiskSpaceError(ZooError):
    """Not enough free space for a download, or a cache / state folder that cannot be written."""


def free_space_check(need: int, folder: Path, what: str, env_var: str) -> None:
    """Raise `DiskSpaceError` when the disk holding `folder` has less than `need` bytes free."""
    if need <= 0:
        return
    from dflash_zoo.output import human_size

    where = _existing_parent(folder)
    free = shutil.disk_usage(where).free
    if free < need:
        raise DiskSpaceError(
            f"not enough disk space for {what}: {human_size(need)} ({need} bytes) to download, "
            f"{human_size(free)} ({free} bytes) free in {where}",
            hint=f"free space there, or point HF_HUB_CACHE at a larger disk (now: {env_var})",
        )


def ensure_writable(path: Path, what: str, env_var: str) -> None:
    """Create `path` if needed and probe it with a temp file; else `DiskSpaceError` naming it, `env_var`."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DiskSpaceError(
            f"cannot write to {what} {path} ({env_var}): {exc.strerror or exc}",
            hint=f"make it writable, or point {env_var.split()[0]} at a writable folder",
        ) from exc


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path
