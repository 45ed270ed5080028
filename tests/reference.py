"""Running z-lab's reference package (`dflash` 0.1.0, installed --no-deps) beside our engines.

`reference_run` runs the reference `dflash_generate` on a target and a drafter directory that we saved, and records
what it verified each step (a forward pre-hook on the target: the hook reads the verify block, it changes
nothing). The reference drafts a shorter block near `max_new_tokens`; only full-block steps are comparable
proposal for proposal (our engines always draft the whole block, engine/run.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


def reference_module():
    return pytest.importorskip("dflash.model", reason="z-lab's reference package `dflash` is not installed")


@dataclass
class ReferenceRun:
    output_ids: list[int]  # new tokens only
    acceptance_lengths: list[int]  # tokens committed per step
    verified: list[list[int]]  # each step's verify block: [bonus] + drafts


def load_reference_drafter(directory, dflash2: bool):
    """The reference class loads our save; every tensor must be consumed and none missing."""
    mod = reference_module()
    cls = mod.DFlash2DraftModel if dflash2 else mod.DFlashDraftModel
    model, info = cls.from_pretrained(str(directory), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def reference_run(ref_drafter, target, prompt: list[int], max_new_tokens: int, **sampling) -> ReferenceRun:
    """The reference loop on `prompt`. Acceptance lengths come from where each verify block starts (its
    `position_ids`): the reference's own stats call `torch.cuda.synchronize`, which a CPU build lacks."""
    mod = reference_module()
    verified: list[list[int]] = []
    starts: list[int] = []

    def record(_module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        verified.append(ids[0].tolist())
        starts.append(int(kwargs["position_ids"][0, 0]))

    handle = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = mod.dflash_generate(
            ref_drafter, target, torch.tensor([prompt]), max_new_tokens, stop_token_ids=None, **sampling
        )
    finally:
        handle.remove()
    new = out[0, len(prompt) :].tolist()
    ends = starts[2:] + [len(prompt) + len(new) - 1]  # where the next step's bonus sits
    lengths = [end - start for start, end in zip(starts[1:], ends, strict=True)]
    return ReferenceRun(new, lengths, verified[1:])
