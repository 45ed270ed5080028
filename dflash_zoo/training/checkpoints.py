"""Crash-safe training checkpoints under `<out>-checkpoint/`.

Each checkpoint is its own directory `step-NNNNNNNN/` holding the fp32 drafter (`config.json`,
`model.safetensors`), `trainer_state.pt` (step, optimizer, anchor RNG) and, written last, `COMPLETE`. It is
written as a hidden `.step-NNNNNNNN.tmp-XXXXXXXX/`, every file and the directory fsynced, then renamed into
place; only then are older checkpoints removed. A kill at any instant therefore leaves the previous complete
checkpoint or the new one. `--resume` takes the newest directory with `COMPLETE` and names the ones it skips.
A flat `<out>-checkpoint/trainer_state.pt` (the layout before step directories) is still read.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from dflash_zoo.engine import outdir
from dflash_zoo.errors import CheckpointError, ZooError

log = logging.getLogger("dflash_zoo")

STATE_FILE = "trainer_state.pt"
DONE_FILE = "COMPLETE"
_STEP = re.compile(r"step-(\d{8,})")
_TEMP = re.compile(r"\.step-\d{8,}\.tmp-[0-9a-f]{8}")


def root_for(out: str | Path) -> Path:
    """The checkpoint directory of an output directory: the sibling `<out>-checkpoint`."""
    out = outdir.norm(out)
    return out.with_name(f"{out.name}-checkpoint")


def _ours(root: Path) -> bool:
    """True when every entry of `root` is a checkpoint dir, a temp dir of ours or a legacy flat file."""
    for p in root.iterdir():
        if p.is_dir() and _STEP.fullmatch(p.name):
            if not all(f.is_file() and f.name in outdir.OUR_FILES for f in p.iterdir()):
                return False
        elif p.is_dir() and _TEMP.fullmatch(p.name):  # a save in progress or interrupted
            if not all(outdir.is_leftover_file(f) for f in p.iterdir()):
                return False
        elif not (p.is_file() and p.name in outdir.OUR_FILES):
            return False
    return True


def check_root(root: Path) -> None:
    """Refuse a checkpoint location that is not writable or holds files we did not write (before any work)."""
    if root.exists() and (root.is_symlink() or not root.is_dir()):
        raise outdir.OutputError(f"checkpoint location {root} exists and is not a directory")
    outdir.check_writable(root, "checkpoint directory")
    if root.is_dir() and not _ours(root):
        raise outdir.OutputError(
            f"checkpoint directory {root} holds files dflash-zoo did not write",
            hint="move them away or choose another --out",
        )


def find(root: Path) -> tuple[Path | None, list[Path]]:
    """(newest complete checkpoint or None, incomplete checkpoints skipped on the way, newest first)."""
    if not root.is_dir():
        return None, []
    dirs = [p for p in root.iterdir() if p.is_dir() and (_STEP.fullmatch(p.name) or _TEMP.fullmatch(p.name))]
    dirs.sort(
        key=lambda p: (int(re.search(r"\d{8,}", p.name).group()), p.name.startswith("step")), reverse=True
    )
    skipped = []
    for p in dirs:
        if _STEP.fullmatch(p.name) and (p / DONE_FILE).is_file():
            return p, skipped
        skipped.append(p)
    if (root / STATE_FILE).is_file():  # legacy flat layout
        return root, skipped
    return None, skipped


def latest(root: Path) -> Path:
    """The checkpoint `--resume` uses; logs the incomplete ones it skips; raises when there is none."""
    found, skipped = find(root)
    for p in skipped:
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
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = outdir.new_temp_dir(final)
    try:
        write(tmp)
        (tmp / DONE_FILE).write_text(json.dumps({"step": step}) + "\n")
        outdir.fsync_tree(tmp)
        outdir.swap_in(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for p in root.iterdir():
        stale = p.is_dir() and p != final and (_STEP.fullmatch(p.name) or _TEMP.fullmatch(p.name))
        if stale or (p.is_file() and p.name in outdir.OUR_FILES):  # older checkpoints, leftovers, flat files
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    outdir.fsync_path(root)
    return final


def remove(root: Path) -> None:
    """Delete the checkpoints of a finished run (only what `save` writes; the directory if then empty)."""
    if not root.is_dir() or not _ours(root):
        return
    for p in root.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    root.rmdir()
