"""Write a loaded drafter in a layout: `config.json` + `model.safetensors`, swapped into place (torch).

The tensors are the drafter's own, renamed for the layout and never cast, so a conversion is bit-exact; the
config is the layout's translation of the `DraftConfig` (`zlab`: engine/checkpoint.py `draft_config_dict`;
`speculators` / `hf-native`: their modules), which refuses what the layout cannot express before anything is
written. A speculators checkpoint names its verifier and carries its embedding, head and final norm: those come
from a target (`Verifier`), never invented. Output goes to a temporary sibling renamed into place
(engine/outdir.py): a directory dflash-zoo did not write is replaced only with `overwrite`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflash_zoo.engine import outdir
from dflash_zoo.errors import DrafterFormatError
from dflash_zoo.formats import (
    HF_NATIVE,
    SPECULATORS,
    ZLAB,
    check_expressible,
    hf_native,
    speculators,
    weights,
)


@dataclass(frozen=True)
class Verifier:
    """The target a speculators checkpoint names, and its tensors the checkpoint carries."""

    name_or_path: str
    architectures: tuple[str, ...]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, compare=False)  # part -> tensor

    def copies(self, d2t: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The verifier copies under their speculators names; with a reduced vocabulary (`d2t` [Vd]) the head's
        copy is its rows of the draft vocabulary, and `lm_head` is the drafter's own."""
        head = self.tensors["head"]
        if d2t is not None:
            return {
                "embed_tokens.weight": self.tensors["embedding"],
                "verifier_lm_head.weight": head[weights.draft_ids(d2t.cpu())],
                "verifier_norm.weight": self.tensors["final norm"],
            }
        return {
            "embed_tokens.weight": self.tensors["embedding"],
            "lm_head.weight": head,
            "verifier_lm_head.weight": head,
            "verifier_norm.weight": self.tensors["final norm"],
        }


def layout_config(layout: str, cfg: Any, verifier: Verifier | None) -> dict[str, Any]:
    """The layout's `config.json` for `cfg`, or `DrafterFormatError` with what it cannot express."""
    check_expressible(layout, cfg, has_target=verifier is not None)
    if layout == HF_NATIVE:
        return hf_native.from_draft(cfg)
    if layout == SPECULATORS:
        archs = list(verifier.architectures)
        return speculators.from_draft(cfg, {"name_or_path": verifier.name_or_path, "architectures": archs})
    from dflash_zoo.engine.checkpoint import draft_config_dict

    raw = draft_config_dict(cfg)
    raw.pop("quantization_config", None)  # the weights written are the dequantized ones
    return raw


def layout_tensors(layout: str, model: Any, verifier: Verifier | None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `model` in `layout`: its own, renamed, plus a speculators verifier's copies."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.checkpoint_state().items()}
    copies = {}
    if layout == SPECULATORS and verifier is not None:
        d2t = state.get("d2t") if model.cfg.draft_vocab_size else None
        # cloned: a tied target head and embedding must not share storage in the file
        copies = {k: v.detach().to("cpu").clone() for k, v in verifier.copies(d2t).items()}
    return weights.to_layout(layout, model.cfg, state, copies)


def save_layout(
    model: Any, layout: str, out: str | Path, verifier: Verifier | None = None, overwrite: bool = False
) -> Path:
    """Write `model` as a `layout` checkpoint at `out` (temporary sibling, fsync, swap); returns the path."""
    if layout not in (ZLAB, SPECULATORS, HF_NATIVE):
        raise DrafterFormatError(f"unknown layout {layout!r}")
    raw = layout_config(layout, model.cfg, verifier)  # refusals first: nothing is written for them
    tensors = layout_tensors(layout, model, verifier)
    target = outdir.norm(out)
    outdir.check_output(target, overwrite)
    outdir.recover(target)
    tmp = outdir.new_temp_dir(target)
    try:
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        save_file(
            tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", outdir.OWNER_KEY: outdir.OWNER}
        )
        outdir.normal_mode(tmp / "model.safetensors")
        outdir.fsync_tree(tmp)
        outdir.swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
