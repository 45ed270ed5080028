"""Tapped target features for training: one right-padded forward of the frozen target per batch.

Only the tapped layers' outputs are kept (the adapter's forward hooks), and unless told otherwise the forward
stops right after the last tapped layer: a forward hook on that layer raises `_StopForward` once the taps have
recorded (hooks run in registration order, the taps' first), so neither the later layers nor the LM head run.
The forward runs under `no_grad` (not `inference_mode`: the features enter `fc`, whose backward keeps them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from dflash_zoo.training.blocks import to_device


class _StopForward(Exception):
    """Raised by the hook on the last tapped layer to end the target's forward there."""


@contextmanager
def stop_after(layer: torch.nn.Module) -> Iterator[None]:
    """End any forward through `layer` right after it by raising `_StopForward` (`target_features` catches it)."""

    def hook(_module, _args, _output):
        raise _StopForward

    handle = layer.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def padded_ids(seqs: Sequence[Sequence[int]], device: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ids [b, T], attention mask [b, T]), right-padded with 0 / mask 0. The mask is None when no row is
    padded: transformers then takes its plain causal path instead of inspecting the mask on the host."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([list(s) + [0] * (width - len(s)) for s in seqs])  # [b, T]
    if all(len(s) == width for s in seqs):
        return to_device(ids, device), None
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return to_device(ids, device), to_device(mask, device)


def target_features(
    model: Any,
    adapter: Any,
    taps: Sequence[int],
    seqs: Sequence[Sequence[int]],
    device: Any,
    stop: bool = True,
) -> torch.Tensor:
    """[b, T, K*H] features of right-padded `seqs` (rows past a sequence's length are padding).

    Args:
        stop: end the forward after the last tapped layer (False runs the whole model, LM head of the last
            position only: sharded targets, whose ranks must run the same modules).
    """
    ids, mask = padded_ids(seqs, device)
    last = adapter.layers()[max(taps)]
    with torch.no_grad(), adapter.tap(taps) as rec, stop_after(last) if stop else nullcontext():
        try:
            model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
        except _StopForward:
            pass
        return rec.take()  # [b, T, K*H]
