"""`train`'s drafter-shape options against the drafter a run continues, checked before the target loads.

A resumed run continues its checkpoint's drafter and `--init` starts from the given one: their shape wins. An
option given on the command line that says otherwise (`--draft-layers`, `--block-size`, `--target-layer-ids`,
and for a checkpoint `--arch` and `--no-target-features`) is a usage error naming the drafter's value; left
out, the drafter's value is used (and recorded in `training_args.json`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click


@dataclass(frozen=True)
class ShapeOption:
    """A shape option: its flag, its `train` parameter, what it is called and its value in a draft config."""

    flag: str
    name: str
    label: str
    value: Callable[[Any], str]


def _taps(text: str) -> str:
    return ",".join(x.strip() for x in text.split(","))


SHAPE = (
    ShapeOption("--draft-layers", "draft_layers", "layers", lambda c: str(c.num_hidden_layers)),
    ShapeOption("--block-size", "block_size", "block size", lambda c: str(c.block_size)),
    ShapeOption(
        "--target-layer-ids", "target_layer_ids", "taps", lambda c: ",".join(map(str, c.target_layer_ids))
    ),
    ShapeOption("--arch", "arch", "architecture", lambda c: c.arch),  # checked for checkpoints only
)


def draft_config(directory: Path | None) -> Any:
    """The `DraftConfig` of a local drafter directory (None: a Hub id, or a config only the loader reads)."""
    from dflash_zoo.engine.config import load_draft_config
    from dflash_zoo.errors import ZooError

    if directory is None or not (directory / "config.json").is_file():
        return None
    try:
        return load_draft_config(directory)
    except ZooError:  # reported, with its own message, when the drafter loads
        return None


def check(p: dict, found: Path | None) -> Any:
    """Refuse shape options that differ from the checkpoint `found` (--resume) or the local --init drafter.
    Returns that drafter's `DraftConfig` (None when there is none to read)."""
    from click.core import ParameterSource

    source = found if found is not None else (Path(p["init"]).expanduser() if p["init"] else None)
    dcfg = draft_config(source)
    if dcfg is None:
        return None
    ctx = click.get_current_context()
    for opt in SHAPE:
        if opt.name == "arch" and found is None:
            continue  # --init with --arch dflash2 upgrades a DFlash drafter (train_arch.py)
        if ctx.get_parameter_source(opt.name) is not ParameterSource.COMMANDLINE:
            continue
        mine = _taps(p[opt.name]) if opt.name == "target_layer_ids" else str(p[opt.name])
        if mine != opt.value(dcfg):
            _refuse(opt.flag, mine, f"{opt.label} {opt.value(dcfg)}", found)
    if found is not None and p["no_target_features"] != fc_frozen(found):
        from dflash_zoo.errors import InvalidArgumentError

        trained = "without" if p["no_target_features"] else "with"
        raise InvalidArgumentError(
            f"the checkpoint {found} was trained {trained} --no-target-features",
            hint=f"resume {trained} --no-target-features (a resumed run continues the checkpoint's drafter), "
            "or start a new run with another --out",
        )
    return dcfg


def _refuse(flag: str, mine: str, theirs: str, found: Path | None) -> None:
    from dflash_zoo.errors import InvalidArgumentError

    if found is None:
        raise InvalidArgumentError(
            f"{flag} {mine} differs from the --init drafter's {theirs}",
            hint=f"drop {flag} (a drafter keeps the shape it was trained with), or train a new one "
            "without --init",
        )
    raise InvalidArgumentError(
        f"{flag} {mine} differs from the checkpoint's {theirs} ({found})",
        hint=f"drop {flag} (a resumed run continues the checkpoint's drafter), or start a new run with "
        "another --out",
    )


def fc_frozen(checkpoint: Path) -> bool:
    """True when the checkpoint's `fc` is zero (`--no-target-features` freezes it there); its first row is
    read (a trained fc is never exactly zero)."""
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        if "fc.weight" not in f.keys():
            return False
        return not bool(f.get_slice("fc.weight")[:1].any())
