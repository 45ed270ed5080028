"""Training blocks: anchors, block inputs, the training attention layout, slot weights and the loss.

Recipe facts (docs/method.md §6; paper v1 §4.2, app. A.1; anchor rule as in SpecForge
`dflash_family_model.py`): anchors are drawn among positions whose token and next token are both supervised;
slot k of a block holds the mask token (slot 0: the anchor's own token) and is labelled with the token at
anchor + k; a block's queries see target context strictly before the anchor and their own block only;
slot weights are w_k = exp(-(k-1)/gamma) for k >= 1, slot 0 unsupervised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from dflash_zoo.engine.drafter import Span

if TYPE_CHECKING:
    from dflash_zoo.training.data import Example


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


@dataclass
class Batch:
    """A padded training batch: b sequences, n anchor slots each (rows with fewer anchors are padded)."""

    ids: torch.Tensor  # [b, T] right-padded token ids
    lengths: torch.Tensor  # [b] real lengths
    anchors: torch.Tensor  # [b, n] anchor positions (padding slots: 0)
    real: torch.Tensor  # [b, n] True for drawn anchors, False for padding slots


def make_batch(seqs: list[list[int]], anchors: list[torch.Tensor], device: Any = "cpu") -> Batch:
    """Pad sequences and their anchor lists into one `Batch`."""
    width, n = max(map(len, seqs)), max(1, max(len(a) for a in anchors))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)  # [b, T]
    pad = torch.zeros(len(seqs), n, dtype=torch.long)
    real = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, a in enumerate(anchors):
        pad[i, : len(a)], real[i, : len(a)] = a, True
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    return Batch(ids, lengths, pad.to(device), real.to(device))


def make_blocks(batch: Batch, block_size: int, mask_id: int, weights: torch.Tensor):
    """Block inputs, labels, weights and the training `Span`, one row per sequence.

    Returns block_ids [b, n*B], labels [b, n*B], w [b, n*B], span (q over each row's n*B block slots).
    """
    ids, b = batch.ids, block_size
    rows, t = ids.shape
    pos = batch.anchors[..., None] + torch.arange(b, device=ids.device)  # [rows, n, B]
    valid = (pos < batch.lengths[:, None, None]) & batch.real[..., None]
    labels = ids.gather(1, pos.clamp(max=t - 1).flatten(1)).view_as(pos)
    block = torch.full_like(pos, mask_id)
    block[..., 0] = ids.gather(1, batch.anchors)
    w = weights.to(ids.device) * valid  # [rows, n, B]; slot 0 already 0
    n = pos.shape[1]
    span = Span(
        q_pos=pos.flatten(1),
        ctx_pos=torch.arange(t, device=ids.device),
        q_limit=batch.anchors[..., None].expand(-1, -1, b).flatten(1),  # context strictly before the anchor
        q_segment=torch.arange(n, device=ids.device).repeat_interleave(b),  # [n*B]: no block sees another
    )
    return block.flatten(1), labels.flatten(1), w.flatten(1), span


def block_loss(
    drafter: Any, adapter: Any, batch: Batch, feats: torch.Tensor, mask_id: int, weights: torch.Tensor
) -> tuple[torch.Tensor, float, int]:
    """Weighted CE over every block of a batch in one drafter call. feats [b, T, K*H].

    Returns (loss, tau estimate, #supervised slots); tau estimate: 1 + the mean accepted prefix length if
    the argmax drafts were verified against the labels (real blocks only).
    """
    b = len(weights)
    block, labels, w, span = make_blocks(batch, b, mask_id, weights)
    with torch.no_grad():
        emb = adapter.embed(block)  # [rows, n*B, H]
    dtype = next(drafter.parameters()).dtype
    h = drafter(emb.to(dtype), feats.to(dtype), span)  # [rows, n*B, H]
    keep = w > 0
    logits = adapter.logits(h[keep].to(emb.dtype)).float()  # [M, V]
    ce = F.cross_entropy(logits, labels[keep], reduction="none")
    loss = (ce * w[keep]).sum() / w[keep].sum()
    with torch.no_grad():
        hit = torch.zeros_like(w, dtype=torch.bool)
        hit[keep] = logits.argmax(-1) == labels[keep]
        runs = 1 + hit.view(-1, b)[:, 1:].long().cumprod(1).sum(1).float()  # [rows*n]
        tau = runs[batch.real.flatten()].mean()
    return loss, float(tau), int(keep.sum())


def lr_factor(progress: float, warmup: float) -> float:
    """Linear warmup to 1 over `warmup` of training, then cosine to 0."""
    if progress < warmup:
        return progress / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / max(1e-8, 1 - warmup))))


def target_features(
    model: Any, adapter: Any, taps: tuple[int, ...], batch: list[Example], device: Any
) -> list[torch.Tensor]:
    """One right-padded target forward with taps; per sequence [T_i, K*H] (padding never precedes a token)."""
    width = max(len(ex.ids) for ex in batch)
    ids = torch.tensor([list(ex.ids) + [0] * (width - len(ex.ids)) for ex in batch], device=device)  # [b, T]
    mask = torch.tensor([[1] * len(ex.ids) + [0] * (width - len(ex.ids)) for ex in batch], device=device)
    with torch.no_grad(), adapter.tap(taps) as rec:
        model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
        feats = rec.take()  # [b, T, K*H]
    return [feats[i, : len(ex.ids)] for i, ex in enumerate(batch)]
