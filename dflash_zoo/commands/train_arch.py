"""`train`'s drafter-architecture options: `--arch dflash|dflash2` and DFlash 2's shapes and selector weight.

Defaults are the published DFlash 2 shapes (kernel 2, group 16, rank 256, top-16: the Qwen3.8-27B and
Muse-Glimmer-30B drafters, and speculators' defaults) and speculators' selector weight of 1. `--init` with a
DFlash drafter and `--arch dflash2` upgrades it: its layers carry over, DFlash 2's parts start neutral.
"""

from __future__ import annotations

from typing import Any

import click

from dflash_zoo.commands.run import Finite


def arch_options(fn):
    """The options of this module, added to `train`."""
    options = [
        click.option("--arch", type=click.Choice(["dflash", "dflash2"]), default=None,
                     help="Drafter architecture (default: dflash, or the --init drafter's). dflash2 adds "
                     "convolutions along the block and a candidate selector (docs/method.md)."),
        click.option("--conv-kernel-size", type=click.IntRange(min=1), default=2, show_default=True,
                     help="dflash2: taps of each convolution along the block."),
        click.option("--conv-group-size", type=click.IntRange(min=1), default=16, show_default=True,
                     help="dflash2: channels sharing one dynamic coefficient (must divide the hidden size)."),
        click.option("--selector-rank", type=click.IntRange(min=1), default=256, show_default=True,
                     help="dflash2: rank of the selector's transition score."),
        click.option("--selector-top-k", type=click.IntRange(min=1), default=16, show_default=True,
                     help="dflash2: candidates per slot the selector chooses among."),
        click.option("--selector-loss-weight", type=Finite(min=0), default=1.0, show_default=True,
                     help="dflash2: weight of the selector's loss beside the DFlash loss."),
    ]  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


def preflight(p: dict) -> None:
    """Checks before any model loads: DFlash 2 options only make sense with --arch dflash2."""
    import math

    if not math.isfinite(p["selector_loss_weight"]):
        raise click.UsageError("--selector-loss-weight must be a finite number")
    if p["conv_kernel_size"] > p["block_size"]:
        raise click.UsageError(
            f"--conv-kernel-size {p['conv_kernel_size']} exceeds --block-size {p['block_size']}: "
            "a convolution reads inside one block"
        )


def config_values(p: dict) -> dict[str, Any]:
    """`TrainConfig` fields these options set."""
    from dflash_zoo.drafters import DFlash2Params

    params = DFlash2Params(
        p["conv_kernel_size"], p["conv_group_size"], p["selector_rank"], p["selector_top_k"]
    )
    return {"arch": p["arch"], "dflash2": params, "selector_loss_weight": p["selector_loss_weight"]}
