"""The on-disk state of a server regeneration (`regenerate.py`): an append-only JSONL of finished prompts, and
the final file in the built-in path's cache format, written through a fsynced temporary sibling.

Partial file lines: `{"index": i, "ids": [...], "start": n}` (i: the prompt's position in the data). Appends
are sequential and fsynced per batch, so only the last line can be torn (a kill mid-write): `load_partial`
drops it and cuts the file back before anything is appended again.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from dflash_zoo.engine.outdir import fsync_path
from dflash_zoo.errors import ZooError
from dflash_zoo.training.data import Example

log = logging.getLogger("dflash_zoo")


class RegenerationError(ZooError):
    """The server could not regenerate a prompt (after retries), answered something unusable, or the saved
    state is damaged."""


def load_partial(path: Path) -> dict[int, Example]:
    """Finished prompts of an interrupted run. A last line without its newline was torn by a kill: it is
    cut off the file. A damaged complete line is an error (nothing we write can leave one)."""
    if not path.is_file():
        return {}
    data = path.read_bytes()
    *lines, torn = data.split(b"\n")
    done = {}
    for n, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
            done[int(row["index"])] = Example(tuple(row["ids"]), int(row["start"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise RegenerationError(
                f"regeneration state {path}:{n} is damaged", hint=f"delete {path} to regenerate from scratch"
            ) from exc
    if torn:
        log.warning("regeneration state %s: dropped a line torn by an interrupted write", path)
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(torn))
            os.fsync(f.fileno())
    return done


def read_examples(path: Path) -> list[Example]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [Example(tuple(r["ids"]), r["start"]) for r in rows]


def write_examples(path: Path, examples: list[Example]) -> None:
    """The built-in cache format, through a fsynced temporary sibling renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps({"ids": list(e.ids), "start": e.start}) + "\n" for e in examples))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
