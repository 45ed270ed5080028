"""Directories the tool writes: refuse what it did not write, replace by a swap, clean up its own leftovers.

A directory is *ours* when every entry in it is a file name our writers produce and its `model.safetensors`
carries the metadata tag our writers put in at creation (`OWNER_KEY`); file names alone never prove it (a
user's drafter has the same ones). Anything else is the user's and is replaced only with an explicit
`overwrite`; the installed package (the embedded demo pair) is never an output, whatever the flags.

New content goes into a hidden sibling `.NAME.tmp-XXXXXXXX` (normal permissions under the umask), is fsynced,
then swapped in: NAME is renamed to `.NAME.old-XXXXXXXX`, the new directory renamed to NAME, and only then the
old one removed. A kill at any point leaves NAME or its `.old-` sibling complete. `recover` (called before the
next write) puts a lone `.old-` sibling back and removes the other leftovers holding only our files, naming
each; a directory named like early versions' temporaries is only named, never removed.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from pathlib import Path

from dflash_zoo.errors import InvalidArgumentError, ZooError

log = logging.getLogger("dflash_zoo")

OWNER_KEY = "written_by"
OWNER = "dflash-zoo"
# every file name our drafter / checkpoint writers produce; a directory holding anything else is not ours
OUR_FILES = frozenset(
    {"config.json", "model.safetensors", "training_args.json", "trainer_state.pt", "COMPLETE"}
)
# the files only a training checkpoint holds (optimizer state, the completion record): more than a drafter
CHECKPOINT_FILES = frozenset({"trainer_state.pt", "COMPLETE"})
# safetensors 0.8 writes `model.safetensors` through a `.tmpXXXXXX` file in the same directory, then renames
# it; a kill in between leaves that file inside our temporary directory
_WRITER_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def is_leftover_file(path: Path) -> bool:
    """True for a file one of our writers can leave in a directory being written: a named file or a writer's
    temporary file."""
    return path.is_file() and (path.name in OUR_FILES or _WRITER_TEMP.fullmatch(path.name) is not None)


class OutputError(ZooError):
    """An output location cannot be written."""


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to disk (directories: so that renames inside it persist)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file directly in `directory`, then the directory itself."""
    for f in directory.iterdir():
        if f.is_file():
            fsync_path(f)
    fsync_path(directory)


def norm(path: str | os.PathLike) -> Path:
    """An absolute path with `~`, `.` and `..` resolved lexically (`--out .` has a name and a parent)."""
    return Path(os.path.abspath(Path(path).expanduser()))


def umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, hence the /proc path first)
    os.umask(mask)
    return mask


def normal_mode(path: Path) -> None:
    """Give a file the permissions `open()` would under the umask (some writers create private 0600 files)."""
    os.chmod(path, 0o666 & ~umask())


def new_temp_dir(out: Path, kind: str = "tmp") -> Path:
    """A fresh hidden sibling `.NAME.<kind>-XXXXXXXX` of `out`, created with the umask's permissions."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(100):  # bounded: 32 random bits per try
        tmp = out.parent / f".{out.name}.{kind}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()  # mode 0o777 & ~umask, unlike mkdtemp's private 0o700
            return tmp
        except FileExistsError:
            continue
    raise OutputError(f"cannot create a temporary directory next to {out}")


def is_ours(directory: Path) -> bool:
    """True when `directory` holds only files our writers produce and its weights carry our tag."""
    try:
        names = {p.name for p in directory.iterdir()}
    except OSError:
        return False
    return names <= OUR_FILES and has_tag(directory / "model.safetensors")


def checkpoint_files(directory: Path) -> list[str]:
    """The training checkpoint files `directory` holds (`trainer_state.pt`, `COMPLETE`); none for a drafter."""
    return sorted(name for name in CHECKPOINT_FILES if (directory / name).exists())


def has_tag(weights: Path) -> bool:
    """True when the safetensors file `weights` carries the tag our writers put into its metadata."""
    if not weights.is_file() or weights.is_symlink():
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            return (f.metadata() or {}).get(OWNER_KEY) == OWNER
    except Exception:  # unreadable or truncated header: not something we can vouch for
        return False


def package_dirs() -> tuple[Path, ...]:
    """The installed package's folders (`dflash_zoo`, and `dflash_zoo.adapters` where it lives apart)."""
    import dflash_zoo
    import dflash_zoo.adapters

    return tuple(dict.fromkeys(Path(m.__file__).parent.resolve() for m in (dflash_zoo, dflash_zoo.adapters)))


def in_package(path: Path) -> Path | None:
    """The package folder that `path` is inside of, is, or contains; None when it touches none."""
    real = norm(path).resolve()
    for pkg in package_dirs():
        if real == pkg or pkg in real.parents or real in pkg.parents:
            return pkg
    return None


def check_not_package(path: Path, what: str = "output") -> None:
    """Refuse any write at or around the installed package (its demo pair is read by every default run)."""
    pkg = in_package(path)
    if pkg is not None:
        raise InvalidArgumentError(
            f"refusing to use {norm(path)} as an {what}: it is or holds the installed dflash-zoo package {pkg}",
            hint="choose a directory outside the package (copy the demo pair first to train from it)",
        )


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(path: Path, what: str) -> None:
    """Raise `OutputError` unless a directory can be created at / inside `path` (probed, not guessed)."""
    base = _nearest_existing(path)
    if not base.is_dir():
        raise OutputError(f"{what} {path}: {base} is not a directory", hint="choose another location")
    probe = base / f".dflash-zoo-probe-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        raise OutputError(
            f"{what} {path} is not writable ({exc.strerror or exc})",
            hint="choose a writable location, or fix the permissions / mount",
        ) from exc


def _protected(out: Path) -> str | None:
    """Why `out` must never be replaced wholesale, or None."""
    real, cwd = out.resolve(), Path.cwd().resolve()
    if real == Path(real.anchor):
        return "it is the filesystem root"
    if real == Path.home().resolve():
        return "it is your home directory"
    if cwd == real or real in cwd.parents:
        return "it holds the current directory"
    return None


def check_holds_no_input(out: Path, inputs: dict[str, str | os.PathLike | None]) -> None:
    """Refuse an `out` that is or contains one of the run's inputs (`{"--data": path, ...}`), even with
    `--overwrite`: replacing it would delete what the run reads. `--init` may be `out` itself (continued in
    place: it is read before the swap)."""
    out = norm(out)
    if not out.is_dir():
        return
    real = out.resolve()
    for flag, path in inputs.items():
        if not path or not norm(path).exists():
            continue  # a Hub id, or a missing path reported elsewhere
        where = norm(path).resolve()
        if where == real and flag == "--init":
            continue
        if where == real or real in where.parents:
            raise InvalidArgumentError(
                f"refusing to replace {out}: it holds the {flag} input {path}",
                hint="choose another output directory, or move the input out of it first",
            )


def check_name(out: Path) -> None:
    """Refuse an output name whose temporary sibling `.NAME.tmp-XXXXXXXX` (and `OUT-checkpoint`) the
    filesystem cannot name: the swap at the end would fail after the work is done."""
    out = norm(out)
    need = len(f".{out.name}.tmp-00000000".encode())
    try:
        limit = os.pathconf(_nearest_existing(out.parent), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if need > limit:
        raise InvalidArgumentError(
            f"the output name {out.name[:32]}... ({len(out.name.encode())} bytes) is too long here: writing "
            f"it goes through a hidden sibling of {need} bytes, and names may have {limit}",
            hint=f"choose a name of at most {limit - (need - len(out.name.encode()))} bytes",
        )


def is_mount_point(path: Path) -> bool:
    """True for a mount point, bind mounts of a folder on the same disk included (Linux lists them in
    /proc/self/mountinfo; `os.path.ismount` sees only a change of device)."""
    if os.path.ismount(path):
        return True
    try:
        table = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    real = os.path.realpath(path)
    octal = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space as \040
    return any(octal.sub(lambda m: chr(int(m.group(1), 8)), line.split()[4]) == real for line in table)


def check_output(out: Path, overwrite: bool = False, flag: str = "--overwrite") -> None:
    """Refuse an `out` that cannot be replaced safely; run before any work that would be lost."""
    out = norm(out)
    check_name(out)
    check_not_package(out)  # even with `overwrite`, even when `out` does not exist yet
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise InvalidArgumentError(f"{out} exists and is not a directory", hint="choose another output path")
    check_writable(out.parent if out.exists() else out, "output directory")
    if not out.exists():
        return
    why = _protected(out)
    if why:
        raise InvalidArgumentError(f"refusing to replace {out}: {why}", hint="choose a new output directory")
    # a read-only mount (or, for non-root, a 0555 dir) cannot be swapped
    check_writable(out, "output directory")
    if is_mount_point(out):  # the new output is renamed into place, and a mount point cannot be renamed over
        raise InvalidArgumentError(
            f"{out} is a mount point: the finished output is renamed into its place, which a mount refuses",
            hint=f"write into a directory inside it, e.g. {out / 'drafter'}",
        )
    if not any(out.iterdir()):
        return
    if not overwrite:
        _check_not_checkpoint(out, flag)
    if not overwrite and not is_ours(out):
        raise InvalidArgumentError(
            f"{out} is not empty and was not written by dflash-zoo",
            hint=f"choose a new output directory, or pass {flag} to replace it (its contents are deleted)",
        )


def _check_not_checkpoint(out: Path, flag: str) -> None:
    """Refuse to replace a training checkpoint: a resumable run (optimizer state), not just a drafter."""
    held = checkpoint_files(out)
    if held:
        raise InvalidArgumentError(
            f"{out} is a training checkpoint (it holds {', '.join(held)}): replacing it loses its optimizer state",
            hint=f"choose a new output directory (--init takes a checkpoint's weights), or pass {flag} to "
            "replace it",
        )


def swap_in(tmp: Path, out: Path) -> None:
    """Replace `out` by the complete directory `tmp`: at every instant `out` or its `.old-` sibling is whole."""
    parent = out.parent
    if out.is_dir() and not any(out.iterdir()):
        os.rename(tmp, out)  # POSIX rename replaces an empty directory atomically
    elif out.exists():
        old = parent / f".{out.name}.old-{secrets.token_hex(4)}"
        os.rename(out, old)
        os.rename(tmp, out)
        fsync_path(parent)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)
    fsync_path(parent)


def _leftovers(out: Path) -> tuple[list[Path], list[Path]]:
    """Temporary siblings of `out`: (ours: `.NAME.tmp-XXXXXXXX` / `.NAME.old-XXXXXXXX`, 8 hex digits as
    `new_temp_dir` and `swap_in` name them; legacy: mkdtemp's `.NAME.XXXXXXXX` of early versions, a name a
    user's own hidden copy such as `.NAME.previous` can have too)."""
    ours = re.compile(rf"\.{re.escape(out.name)}\.(?:tmp|old)-[0-9a-f]{{8}}")
    legacy = re.compile(rf"\.{re.escape(out.name)}\.[a-z0-9_]{{8}}")
    try:
        dirs = sorted(p for p in out.parent.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return [], []
    return [p for p in dirs if ours.fullmatch(p.name)], [p for p in dirs if legacy.fullmatch(p.name)]


def _only_our_files(directory: Path) -> bool:
    try:
        return all(is_leftover_file(p) for p in directory.iterdir())
    except OSError:
        return False


_NAMED: set[Path] = set()  # legacy-named directories already reported by this process


def recover(out: Path) -> list[str]:
    """Put back an output an interrupted swap left aside, remove our other leftovers; returns what was done."""
    out = norm(out)
    done: list[str] = []
    ours, legacy = _leftovers(out)
    for p in legacy:
        if _only_our_files(p) and p not in _NAMED:  # never deleted: the name alone does not prove it is ours
            _NAMED.add(p)
            log.warning("%s may be left by an early dflash-zoo version; remove it if you do not need it", p)
    for p in ours:
        if not _only_our_files(p):
            log.warning("leaving %s alone: it holds files dflash-zoo does not write", p)
            continue
        if ".old-" in p.name and not out.exists() and is_ours(p):
            os.rename(p, out)
            done.append(f"restored {out} from {p.name} (an interrupted save had moved it aside)")
        else:
            shutil.rmtree(p)
            done.append(f"removed {p} (left by an interrupted save)")
    for line in done:
        log.warning("%s", line)
    return done
