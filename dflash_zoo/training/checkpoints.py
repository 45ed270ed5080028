"""Crash-safe training checkpoints under `<out>-checkpoint/`.

Each checkpoint is its own directory `step-NNNNNNNN/` holding the fp32 drafter (`config.json`,
`model.safetensors`), `trainer_state.pt` (step, optimizer, anchor RNG) and, written last, `COMPLETE`. It is
written as a hidden `.step-NNNNNNNN.tmp-XXXXXXXX/`, every file and the directory fsynced, then renamed into
place; only then are older checkpoints removed. A kill at any instant therefore leaves the previous complete
checkpoint or the new one. `--resume` takes the newest directory with `COMPLETE` and names the ones it skips.
A flat `<out>-checkpoint/trainer_state.pt` (the layout before step directories) is still read.

Nothing here removes what dflash-zoo did not write. A checkpoint directory is ours when its weights carry
the tag our writers put in at creation (`outdir.has_tag`), and `<out>-checkpoint/` itself when we created it
(the `MARKER` file, written at creation); a user's drafter kept under that name is never ours, whatever its
file names. A fresh run (no `--resume`) beside complete checkpoints of an earlier run refuses unless
`--overwrite`: it would replace them.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from dflash_zoo.engine import outdir
from dflash_zoo.errors import CheckpointError, InvalidArgumentError, ZooError

log = logging.getLogger("dflash_zoo")

STATE_FILE = "trainer_state.pt"
DONE_FILE = "COMPLETE"
MARKER = ".dflash-zoo-checkpoints"  # written into `<out>-checkpoint/` when we create it
_STEP = re.compile(r"step-(\d{8,})")
_TEMP = re.compile(r"\.step-\d{8,}\.tmp-[0-9a-f]{8}")
_FLAT = frozenset({"config.json", "model.safetensors", STATE_FILE})  # the layout before step directories


def root_for(out: str | Path) -> Path:
    """The checkpoint directory of an output directory: the sibling `<out>-checkpoint`."""
    out = outdir.norm(out)
    return out.with_name(f"{out.name}-checkpoint")


def _step_is_ours(p: Path) -> bool:
    """A `step-N/` directory of our writer: only our file names, and weights with our tag or our `COMPLETE`
    record of that step (the weights of a damaged checkpoint may have lost their header)."""
    try:
        names = {f.name for f in p.iterdir() if f.is_file() and not f.is_symlink()}
        everything = {f.name for f in p.iterdir()}
    except OSError:
        return False
    if names != everything or not names <= outdir.OUR_FILES:
        return False
    return outdir.has_tag(p / "model.safetensors") or _completed_step(p) == int(p.name.split("-")[1])


def _completed_step(p: Path) -> int | None:
    """The step our `COMPLETE` file in `p` records, or None."""
    try:
        record = json.loads((p / DONE_FILE).read_text())
    except (OSError, ValueError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def _temp_is_ours(p: Path) -> bool:
    """A `.step-N.tmp-XXXXXXXX/` save in progress (or killed): our random name, only our writers' files."""
    try:
        return all(outdir.is_leftover_file(f) and not f.is_symlink() for f in p.iterdir())
    except OSError:
        return False


def _flat_is_ours(root: Path) -> bool:
    """The legacy flat layout: trainer state beside weights with our tag."""
    return (root / STATE_FILE).is_file() and outdir.has_tag(root / "model.safetensors")


def ours(root: Path) -> list[Path]:
    """The entries of `root` that our writers made (and may remove)."""
    flat = _flat_is_ours(root)
    found = []
    for p in sorted(root.iterdir()):
        if p.is_symlink():
            continue
        if p.is_dir() and _STEP.fullmatch(p.name) and _step_is_ours(p):
            found.append(p)
        elif p.is_dir() and _TEMP.fullmatch(p.name) and _temp_is_ours(p):
            found.append(p)
        elif p.is_file() and (p.name == MARKER or (flat and p.name in _FLAT)):
            found.append(p)
    return found


def foreign(root: Path) -> list[Path]:
    """The entries of `root` that dflash-zoo did not write ([] when `root` is not a directory)."""
    if not root.is_dir() or root.is_symlink():
        return []
    mine = set(ours(root))
    return [p for p in sorted(root.iterdir()) if p not in mine]


def check_root(root: Path, writes: bool = True, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse, before any work, a checkpoint location the run would harm or cannot use.

    Args:
        writes: the run saves checkpoints (`--save-every N`, `--keep-checkpoints`): `root` must be writable and
            hold nothing of the user's. A run that saves none never touches a `root` that is not ours.
        resume: the run continues `root`'s newest checkpoint; without it, complete checkpoints of an earlier
            run there are refused unless `overwrite` (the run would replace them).
    """
    outdir.check_not_package(root, "checkpoint directory")
    if writes:
        if root.is_symlink() or (root.exists() and not root.is_dir()):
            raise outdir.OutputError(
                f"checkpoint location {root} exists and is not a directory",
                hint="move it away, or choose another --out (checkpoints go to OUT-checkpoint/)",
            )
        outdir.check_writable(root, "checkpoint directory")
        if others := foreign(root):
            raise InvalidArgumentError(
                f"checkpoint directory {root} holds files dflash-zoo did not write ({_names(others)})",
                hint="move them away or choose another --out (checkpoints go to OUT-checkpoint/); "
                "nothing there is ever deleted",
            )
    if resume or overwrite or not root.is_dir() or root.is_symlink():
        return
    found = find(root)[0]
    if found is not None:
        raise InvalidArgumentError(
            f"{root} holds the checkpoints of an earlier run (newest: {found.name}); a new run would replace them",
            hint="pass --resume to continue that run, --overwrite to start afresh (they are deleted), "
            "or choose another --out",
        )


def _names(paths: list[Path], most: int = 3) -> str:
    shown = ", ".join(p.name for p in paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


def find(root: Path) -> tuple[Path | None, list[Path]]:
    """(newest complete checkpoint or None, incomplete checkpoints skipped on the way, newest first)."""
    if not root.is_dir():
        return None, []
    dirs = [p for p in ours(root) if p.is_dir()]
    dirs.sort(
        key=lambda p: (int(re.search(r"\d{8,}", p.name).group()), p.name.startswith("step")), reverse=True
    )
    skipped = []
    for p in dirs:
        if _STEP.fullmatch(p.name) and (p / DONE_FILE).is_file():
            return p, skipped
        skipped.append(p)
    if _flat_is_ours(root):  # legacy flat layout
        return root, skipped
    return None, skipped


_REPORTED: set[Path] = set()  # incomplete checkpoints already named by this process


def latest(root: Path) -> Path:
    """The checkpoint `--resume` uses; logs the incomplete ones it skips; raises when there is none."""
    found, skipped = find(root)
    for p in skipped:
        if p not in _REPORTED:  # the command's early check and the trainer both ask
            _REPORTED.add(p)
            log.warning("skipping incomplete checkpoint %s (a save was interrupted)", p)
    if found is None:
        raise ZooError(
            f"nothing to resume: no complete checkpoint in {root}",
            hint="a finished run removes its checkpoints unless --keep-checkpoints; train without --resume",
        )
    return found


def _state_error(path: Path, directory: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"cannot read trainer state {path}: {why}",
        hint=f"remove {directory} to resume from an earlier checkpoint, or train without --resume",
    )


def check_state(directory: Path) -> None:
    """Cheap test (no unpickling, no full read) that `trainer_state.pt` is a whole torch zip archive and the
    weights' header fits their file, so that `--resume` fails before the target loads."""
    import zipfile

    from safetensors import safe_open

    path = directory / STATE_FILE
    if not path.is_file() or path.stat().st_size == 0:
        raise _state_error(path, directory, "the file is missing or empty")
    if not zipfile.is_zipfile(path):  # the zip directory sits at the end: a truncated file has none
        raise _state_error(path, directory, "the file is truncated or not a torch archive")
    weights = directory / "model.safetensors"
    try:
        with safe_open(str(weights), framework="pt") as f:  # checks the header against the file's length
            f.keys()
    except Exception as exc:  # safetensors raises several types for missing / truncated files
        raise CheckpointError(
            f"cannot read checkpoint weights {weights}: {exc}",
            hint=f"remove {directory} to resume from an earlier checkpoint, or train without --resume",
        ) from exc


def load_state(directory: Path) -> dict:
    """`trainer_state.pt` of a checkpoint (tensors only); an empty or truncated file is named."""
    import torch

    path = directory / STATE_FILE
    try:
        state = torch.load(path, weights_only=True)
    except (
        EOFError,
        RuntimeError,
        OSError,
        ValueError,
    ) as exc:  # EOFError: empty file; RuntimeError: truncated
        raise _state_error(path, directory, f"the file is empty or truncated ({type(exc).__name__})") from exc
    if not isinstance(state, dict) or not {"step", "optimizer", "rng"} <= set(state):
        raise CheckpointError(f"trainer state {path} lacks step / optimizer / rng")
    return state


def save(root: Path, step: int, write: Callable[[Path], None]) -> Path:
    """Write checkpoint `step` with `write(tmp_dir)`, mark it complete, swap it in, then drop older ones."""
    _create(root)
    final = root / f"step-{step:08d}"
    tmp = outdir.new_temp_dir(final)
    try:
        write(tmp)
        (tmp / DONE_FILE).write_text(json.dumps({"step": step, "written_by": outdir.OWNER}) + "\n")
        outdir.fsync_tree(tmp)
        outdir.swap_in(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for p in ours(root):  # older checkpoints, interrupted saves, legacy flat files: never the marker
        if p != final and p.name != MARKER:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    outdir.fsync_path(root)
    return final


def _create(root: Path) -> None:
    """Make `root` with our marker inside; a `root` that already exists gets none (we did not create it)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        root.mkdir()
    except FileExistsError:
        return
    (root / MARKER).write_text(json.dumps({"written_by": outdir.OWNER}) + "\n")


def remove(root: Path) -> None:
    """Delete the checkpoints of a finished run: only what our writers made; `root` itself only when we
    created it and nothing else is left in it."""
    if not root.is_dir() or root.is_symlink():
        return
    created = (root / MARKER).is_file()
    for p in ours(root):
        if p.name != MARKER:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    if created and [p.name for p in root.iterdir()] == [MARKER]:
        (root / MARKER).unlink()
        root.rmdir()
