"""Training blocks: anchors, block inputs, the training attention layout, slot weights and the loss.

Recipe facts (dflash-method.md §5; paper v1 §4.2, app. A.1; anchor rule as in SpecForge
`dflash_family_model.py`): anchors are drawn among positions whose token and next token are both supervised;
slot k of a block holds the mask token (slot 0: the anchor's own token) and is labelled with the token at
anchor + k; a block's queries see target context strictly before the anchor and their own block only;
slot weights are w_k = exp(-(k-1)/gamma) for k >= 1, slot 0 unsupervised.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .drafter import Span

if TYPE_CHECKING:
    from .data import Example


def default_gamma(block_size: int) -> float:
    """Decay gamma: 4 / 5 / 7 for B = 8 / 10 / 16 (paper); B/2 up to 10, then 5 + (B-10)/3 (our interpolation)."""
    return block_size / 2 if block_size <= 10 else 5 + (block_size - 10) / 3


def loss_weights(block_size: int, gamma: float | None = None, uniform: bool = False) -> torch.Tensor:
    """[B] slot weights: slot 0 (the anchor) 0, slot k >= 1 exp(-(k-1)/gamma) (or 1 when uniform)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.ones(block_size) if uniform else torch.exp(-(k - 1) / (gamma or default_gamma(block_size)))
    w[0] = 0.0
    return w


def sample_anchors(
    length: int, start: int, block_size: int, count: int, uniform: bool, gen: torch.Generator
) -> torch.Tensor:
    """Sorted anchor positions a with start <= a <= length - 2 (the anchor and its next token supervised)."""
    lo, hi = start, length - 2
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    if uniform:  # consecutive blocks tiling the response; evenly thinned past `count`
        tiles = torch.arange(lo, hi + 1, block_size)
        if len(tiles) > count:
            tiles = tiles[torch.linspace(0, len(tiles) - 1, count).round().long()]
        return tiles
    n = hi - lo + 1
    return (torch.randperm(n, generator=gen)[: min(count, n)] + lo).sort().values


def make_blocks(
    ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int, weights: torch.Tensor
):
    """Block inputs, labels, weights and the training `Span` for one sequence.

    ids [T]; anchors [n]. Returns block_ids [n*B], labels [n*B], w [n*B], span (q over the n*B block slots).
    """
    t, b = len(ids), block_size
    pos = anchors[:, None] + torch.arange(b, device=ids.device)  # [n, B]
    valid = pos < t
    labels = torch.where(valid, ids[pos.clamp(max=t - 1)], torch.zeros_like(pos))
    block = torch.full_like(pos, mask_id)
    block[:, 0] = ids[anchors]
    w = weights.to(ids.device)[None, :] * valid  # [n, B]; slot 0 already 0
    seg = torch.arange(len(anchors), device=ids.device)[:, None].expand(-1, b)
    span = Span(
        q_pos=pos.reshape(-1),
        ctx_pos=torch.arange(t, device=ids.device),
        q_limit=anchors[:, None].expand(-1, b).reshape(-1),  # context keys strictly before the anchor
        q_segment=seg.reshape(-1),  # no block sees another block
    )
    return block.reshape(-1), labels.reshape(-1), w.reshape(-1), span


def block_loss(
    drafter: Any,
    adapter: Any,
    ids: torch.Tensor,
    feats: torch.Tensor,
    anchors: torch.Tensor,
    mask_id: int,
    weights: torch.Tensor,
):
    """Weighted CE of one sequence's blocks. ids [T], feats [1, T, K*H]. Returns (loss, tau estimate, #tokens).

    tau estimate: 1 + the mean accepted prefix length if the argmax drafts were verified against the labels.
    """
    b = len(weights)
    block, labels, w, span = make_blocks(ids, anchors, b, mask_id, weights)
    with torch.no_grad():
        emb = adapter.embed(block[None])  # [1, n*B, H]
    dtype = next(drafter.parameters()).dtype
    h = drafter(emb.to(dtype), feats.to(dtype), span)[0]  # [n*B, H]
    keep = w > 0
    logits = adapter.logits(h[keep].to(emb.dtype)).float()  # [M, V]
    ce = F.cross_entropy(logits, labels[keep], reduction="none")
    loss = (ce * w[keep]).sum() / w[keep].sum()
    with torch.no_grad():
        hit = torch.zeros_like(w, dtype=torch.bool)
        hit[keep] = logits.argmax(-1) == labels[keep]
        tau = 1 + hit.view(-1, b)[:, 1:].long().cumprod(1).sum(1).float().mean()
    return loss, float(tau), int(keep.sum())


def lr_factor(progress: float, warmup: float) -> float:
    """Linear warmup to 1 over `warmup` of training, then cosine to 0."""
    if progress < warmup:
        return progress / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / max(1e-8, 1 - warmup))))


def target_features(
    model: Any, adapter: Any, taps: tuple[int, ...], batch: list[Example], device: Any
) -> list[torch.Tensor]:
    """One right-padded target forward with taps; per sequence [1, T_i, K*H] (padding never precedes a token)."""
    width = max(len(ex.ids) for ex in batch)
    ids = torch.tensor([list(ex.ids) + [0] * (width - len(ex.ids)) for ex in batch], device=device)  # [b, T]
    mask = torch.tensor([[1] * len(ex.ids) + [0] * (width - len(ex.ids)) for ex in batch], device=device)
    with torch.no_grad(), adapter.tap(taps) as rec:
        model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
        feats = rec.take()  # [b, T, K*H]
    return [feats[i : i + 1, : len(ex.ids)] for i, ex in enumerate(batch)]
