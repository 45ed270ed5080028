"""The drafter's training forward with a pluggable attention kernel (`attention.Attend`).

`TrainingDrafter` wraps a drafter (any architecture) so that DDP sees one module whose forward is the training
pass. With `dense` attention it calls the drafter itself (the engine's forward, the reference); with `flex` it
calls the same forward with the block-sparse kernel in place of SDPA (the drafter's `attend` argument), so the
layers that train are the layers that draft. Training calls carry no cache: every context position is new.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_zoo.engine.drafter import DFlashDrafter, Span
from dflash_zoo.training.attention import Attend


class TrainingDrafter(nn.Module):
    """The module the trainer optimises (and DDP wraps): `forward(emb, feats, span)` -> final-norm states."""

    def __init__(self, drafter: DFlashDrafter, attention: str):
        super().__init__()
        self.drafter, self.attention = drafter, attention

    def forward(self, emb: torch.Tensor, feats: torch.Tensor, span: Span) -> torch.Tensor:
        if self.attention == "dense":
            return self.drafter(emb, feats, span)
        return self.drafter(emb, feats, span, attend=Attend(span, emb.shape[0], self.attention))


def bare_drafter(module: nn.Module) -> DFlashDrafter:
    """The drafter inside a DDP and/or `TrainingDrafter` wrapper (or `module` itself)."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        module = module.module
    return module.drafter if isinstance(module, TrainingDrafter) else module


def block_embeddings(drafter: DFlashDrafter, adapter: Any, block: torch.Tensor) -> torch.Tensor:
    """[R, N] block ids -> [R, N, H], as the engine embeds a block for this drafter."""
    with torch.no_grad():
        return drafter.embed_block(block, adapter)


def logits_fn(drafter: DFlashDrafter, adapter: Any):
    """h [M, H] -> [M, V] drafter logits as the engine computes them (the target's LM head in its dtype,
    then the drafter's own multiplier / soft-cap)."""
    dtype = adapter.model.get_output_embeddings().weight.dtype
    return lambda h: drafter.draft_logits(h.to(dtype), adapter.head)
