"""Run a command with some directories read-only, as a user would meet them.

`chmod` does not stop root (the tests and CI run as root), so the directories are bind-mounted read-only in a
private mount namespace (`unshare -m`) that lives only as long as the command. Tests skip where the machine
does not allow it.
"""

from __future__ import annotations

import functools
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest


@functools.cache
def readonly_mounts_work() -> bool:
    probe = Path("/tmp") / "dflash-zoo-ro-probe"
    probe.mkdir(exist_ok=True)
    script = f"mount --bind -o ro {probe} {probe} && ! touch {probe}/x 2>/dev/null"
    try:
        done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def run_readonly(
    argv: Sequence[str],
    readonly: Sequence[Path],
    env: dict[str, str] | None = None,
    timeout: float = 600,
    **kw,
) -> subprocess.CompletedProcess:
    """`argv` (e.g. `[sys.executable, "-m", "dflash_zoo", ...]`) with every path of `readonly` mounted read-only."""
    if not readonly_mounts_work():
        pytest.skip("read-only bind mounts (unshare -m) are not available here")
    mounts = " && ".join(f"mount --bind -o ro {shlex.quote(str(p))} {shlex.quote(str(p))}" for p in readonly)
    script = f"{mounts} && exec {shlex.join(argv)}"
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=timeout, **kw
    )


def run_on_mount(
    argv: Sequence[str], mountpoint: Path, source: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`argv` with `source` bind-mounted (writable) at `mountpoint`, as a volume or a second disk is."""
    if not readonly_mounts_work():
        pytest.skip("bind mounts (unshare -m) are not available here")
    script = (
        f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(mountpoint))} && exec {shlex.join(argv)}"
    )
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=timeout
    )


def cli(*args: str) -> list[str]:
    """The argv of a `dflash-zoo` call through this interpreter."""
    return [sys.executable, "-m", "dflash_zoo", *args]
