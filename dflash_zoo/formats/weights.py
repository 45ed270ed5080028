"""A layout's checkpoint tensors under the drafter's own names, and back (torch).

- `zlab`: the drafter's names as they are (engine/drafter.py, drafters/dflash2.py);
- `hf-native`: `encoder.fc` is `fc`, `encoder.output_norm_enc` is `hidden_norm`, the rest is the same;
- `speculators`: the drafter's names, plus the verifier's tensors it carries (`embed_tokens`, `verifier_norm`,
  `verifier_lm_head`, and `lm_head` for a full vocabulary): they are set apart as *copies*, which a pair is
  refused over unless they equal its target's (formats/verifier.py), so none is ignored. A reduced vocabulary
  keeps `lm_head` (its own head) and `d2t`; `t2d` must select exactly the target ids d + d2t[d], and is
  rebuilt from `d2t` on writing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_zoo.errors import DrafterFormatError
from dflash_zoo.formats import HF_NATIVE, SPECULATORS

HF_NATIVE_NAMES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
# the verifier's tensors a speculators checkpoint carries, and which part of the target each copies
VERIFIER_PARTS = {
    "embed_tokens.weight": "embedding",
    "lm_head.weight": "head",
    "verifier_lm_head.weight": "head",
    "verifier_norm.weight": "final norm",
}


@dataclass
class LayoutState:
    """A checkpoint's tensors split into the drafter's (our names) and the verifier copies it carries."""

    state: dict[str, torch.Tensor]
    copies: dict[str, torch.Tensor] = field(default_factory=dict)


def unique(stored: Iterable[tuple[str, str, torch.Tensor]], where: str) -> dict[str, torch.Tensor]:
    """{name: tensor} of stored tensors given as (where it is stored, its name, tensor); two stored tensors of
    one name are refused, naming both (keeping either would run the drafter with the other ignored)."""
    out: dict[str, torch.Tensor] = {}
    came_from: dict[str, str] = {}
    for origin, name, tensor in stored:
        if name in out:
            raise DrafterFormatError(
                f"{where}: {came_from[name]} and {origin} are both the tensor {name}",
                hint="a checkpoint stores each tensor once: remove the stray copy, or save the drafter again",
            )
        out[name], came_from[name] = tensor, origin
    return out


def renamed(state: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """`state` with the tensors of `names` renamed (`unique`: two landing on one name are refused)."""
    return unique(((k, names.get(k, k), t) for k, t in state.items()), "the checkpoint")


def from_layout(cfg: Any, state: dict[str, torch.Tensor]) -> LayoutState:
    """The drafter's tensors of a checkpoint in `cfg.layout`; unknown names stay for the strict check to name."""
    if cfg.layout == HF_NATIVE:
        return LayoutState(renamed(state, HF_NATIVE_NAMES))
    if cfg.layout != SPECULATORS:
        return LayoutState(dict(state))
    state = dict(state)
    own_head = cfg.draft_vocab_size is not None  # a reduced head is the drafter's own, not a verifier copy
    names = [k for k in VERIFIER_PARTS if k in state and not (own_head and k == "lm_head.weight")]
    copies = {k: state.pop(k) for k in names}
    if own_head:
        t2d = state.pop("t2d", None)
        if t2d is None or "d2t" not in state:
            raise DrafterFormatError(
                f"speculators drafter with draft_vocab_size {cfg.draft_vocab_size} has no "
                + ("t2d" if t2d is None else "d2t")
                + " tensor mapping its vocabulary to the target's"
            )
        check_vocab_map(t2d, state["d2t"], cfg)
    return LayoutState(state, copies)


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] target ids of the draft vocabulary: draft id d is target id d + d2t[d]."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()


def check_vocab_map(t2d: torch.Tensor, d2t: torch.Tensor, cfg: Any) -> None:
    """`t2d` [V] must mark exactly the distinct target ids `d2t` [Vd] maps the draft vocabulary to."""
    v, vd = cfg.vocab_size, cfg.draft_vocab_size
    if tuple(t2d.shape) != (v,) or tuple(d2t.shape) != (vd,) or d2t.is_floating_point():
        raise DrafterFormatError(
            f"speculators vocabulary maps have shapes t2d {tuple(t2d.shape)}, d2t {tuple(d2t.shape)} "
            f"({d2t.dtype}); expected ({v},) and ({vd},) integers"
        )
    ids = draft_ids(d2t)
    if bool((ids < 0).any() or (ids >= v).any()) or ids.unique().numel() != vd:
        raise DrafterFormatError(
            "speculators d2t maps draft ids outside the target vocabulary or onto one id twice"
        )
    marked = t2d.bool()
    if int(marked.sum()) != vd or not bool(marked[ids].all()):
        raise DrafterFormatError("speculators t2d does not mark exactly the target ids d2t maps to")


def to_layout(layout: str, cfg: Any, state: dict[str, torch.Tensor], copies: dict[str, torch.Tensor]) -> dict:
    """The checkpoint tensors of a drafter state in `layout` (`copies`: the verifier tensors speculators carries)."""
    if layout == HF_NATIVE:
        back = {ours: theirs for theirs, ours in HF_NATIVE_NAMES.items()}
        return {back.get(k, k): v for k, v in state.items()}
    if layout != SPECULATORS:
        return dict(state)
    out = {**state, **copies}
    if cfg.draft_vocab_size:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[draft_ids(state["d2t"].cpu())] = True
        out["t2d"] = t2d
    return out
