"""The error table: every expected failure is a `ZooError` with a one-line message and a next step.

The CLI prints `error: <message>` and `hint: <hint>` on stderr and exits with `exit_code`; full tracebacks
appear only with `DFLASH_ZOO_DEBUG=1`. Library callers catch `ZooError` (or a subclass).
"""

from __future__ import annotations

import errno
import os


class ZooError(Exception):
    """Base class: a user-facing failure with an optional hint naming the next command."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class ConfigError(ZooError):
    """A draft or target config is malformed or inconsistent."""


class CheckpointError(ZooError):
    """Weights are missing, corrupted or do not fit the config."""


class DrafterFormatError(CheckpointError):
    """A drafter checkpoint is not what its architecture needs: unknown architecture, missing or unconsumed
    tensors, a config dialect that cannot be read. A usage error: the fix is a different drafter or a convert."""

    exit_code = 2


class IncompatiblePairError(ZooError):
    """Target and drafter do not fit together (hidden size, taps, mask id, ...)."""

    exit_code = 3


class UnsupportedModelError(ZooError):
    """No adapter for this model type, or its cache cannot be rolled back."""


class InvalidArgumentError(ZooError):
    """A generation argument is out of range (block size, max tokens, temperature...)."""

    exit_code = 2


class NotFoundError(ZooError):
    """A path, repo, revision or registry entry does not exist."""


class OfflineError(ZooError):
    """Offline mode is on and what was asked for is not cached."""


class PipeClosedError(Exception):
    """stdout was closed by its reader (`dflash-zoo generate ... | head -1`): the CLI exits 0 quietly.

    Not an `OSError` on purpose: click turns a `BrokenPipeError` into exit 1 before the CLI could see it.
    """


def hint_for(exc: ZooError) -> str:
    """The error's own hint, else the next step its kind always has (every error the CLI prints has one)."""
    if exc.hint:
        return exc.hint
    for kind, hint in _KIND_HINTS:
        if isinstance(exc, kind):
            return hint
    return (
        "`dflash-zoo COMMAND --help` shows what each argument takes; DFLASH_ZOO_DEBUG=1 shows where it failed"
    )


_KIND_HINTS: tuple[tuple[type[ZooError], str], ...] = (
    (IncompatiblePairError, "`dflash-zoo check --target T --draft D` explains the pair"),
    (InvalidArgumentError, "`dflash-zoo COMMAND --help` shows what each argument takes"),
    (NotFoundError, "check the name or path; `dflash-zoo list` shows the registry ids"),
    (OfflineError, "run the command online once (HF_HUB_OFFLINE unset), or `dflash-zoo pull ID` first"),
    (
        ConfigError,
        "fix the file it names (or fetch it again); `dflash-zoo check` reads configs without loading",
    ),
    (CheckpointError, "fetch the files again (`dflash-zoo pull ID --verify --force`), or save them again"),
    (UnsupportedModelError, "`dflash-zoo list` shows the supported pairs and families"),
)


def from_exception(exc: BaseException) -> ZooError | None:
    """A `ZooError` for a well-known failure that reached the CLI unhandled (file system, CUDA), else None."""
    if isinstance(exc, OSError) and exc.errno in _FS_ERRNOS:
        return _fs_error(exc)
    text = str(exc)
    if "not compiled with CUDA" in text or "no CUDA GPUs are available" in text or "CUDA driver" in text:
        return no_gpu_error("cuda")
    return None


def no_gpu_error(device: str) -> ZooError:
    """`device` names a GPU that torch cannot use here."""
    import torch  # only called after torch was asked for a device

    why = "this torch build has no CUDA support" if torch.version.cuda is None else "torch sees no CUDA GPU"
    return ZooError(
        f"device {device!r} was asked for but {why}",
        hint="run with --device cpu, or install a CUDA build of torch (`dflash-zoo env` shows what torch sees)",
    )


_FS_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


def _fs_error(exc: OSError) -> ZooError:
    """One line naming the path, and the environment variable that moves it when it is one of ours."""
    path = exc.filename or "a file"
    if exc.errno == errno.EROFS:
        message = f"cannot write to {path}: read-only file system"
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        message = f"no space left writing {path} ({exc.strerror})"
    elif exc.filename and not _readable(str(path)):  # EACCES on a read: a write hint would mislead
        return ZooError(
            f"cannot read {path}: permission denied",
            hint=f"make it readable (chmod a+r {path}), or run as a user who can read it",
        )
    else:
        message = f"permission denied: {path}"
    return ZooError(message, hint=_location_hint(str(path)))


def _readable(path: str) -> bool:
    """False when `path` exists but this process cannot read it (or list it, for a directory), tried for
    real: `os.access` answers for the real user, not the capabilities the process has."""
    try:
        os.lstat(path)
    except PermissionError:
        return False  # a folder on the way cannot be searched
    except OSError:
        return True  # nothing to read: the error came from creating it
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb"):
                pass
    except PermissionError:
        return False
    except OSError:
        return True
    return True


def _location_hint(path: str) -> str:
    homes = {
        "HF_HUB_CACHE": os.environ.get("HF_HUB_CACHE"),
        "HF_HOME": os.environ.get("HF_HOME")
        or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"),
        "DFLASH_ZOO_HOME": os.environ.get("DFLASH_ZOO_HOME")
        or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dflash-zoo"),
    }
    real = os.path.realpath(path)
    for var, home in homes.items():
        if home and (real == os.path.realpath(home) or real.startswith(os.path.realpath(home) + os.sep)):
            tail = "; HF_HUB_OFFLINE=1 uses only what is cached" if var.startswith("HF_") else ""
            return f"make {home} writable, or point {var} at a writable directory{tail}"
    return "choose a writable location, or fix the permissions / the mount"


def looks_like_path(name: str) -> bool:
    """A model argument meant as a local path: it starts with `/`, `.` or `~`, or has more than one `/`
    (a Hub id is ORG/NAME, a registry id has no `/`)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def missing_directory(name: str) -> NotFoundError:
    """The one message for a path-looking model argument that is not a directory (target and drafter alike)."""
    path = os.path.expanduser(name)
    what = (
        f"{name} is a file, not a model directory" if os.path.exists(path) else f"no such directory: {name}"
    )
    return NotFoundError(
        what, hint="check the path; a Hub id is ORG/NAME and `dflash-zoo list` shows the registry ids"
    )
