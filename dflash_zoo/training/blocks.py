"""Training blocks: anchors, block inputs, the training attention layout, slot weights and the loss.

Recipe facts (docs/method.md §6; paper v1 §4.2, app. A.1; anchor rule as in SpecForge
`dflash_family_model.py`): anchors are drawn among positions whose token and next token are both supervised;
slot k of a block holds the mask token (slot 0: the anchor's own token) and is labelled with the token at
anchor + k; a block's queries see target context strictly before the anchor and their own block only;
slot weights are w_k = exp(-(k-1)/gamma) for k >= 1, slot 0 unsupervised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dflash_zoo.engine.drafter import Span
from dflash_zoo.training.head_loss import head_loss


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
    """Pad sequences and their anchor lists into one `Batch` (built on the host, copied without a sync)."""
    width, n = max(map(len, seqs)), max(1, max(len(a) for a in anchors))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])  # [b, T]
    pad = torch.zeros(len(seqs), n, dtype=torch.long)
    real = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, a in enumerate(anchors):
        pad[i, : len(a)], real[i, : len(a)] = a, True
    lengths = torch.tensor([len(s) for s in seqs])
    return Batch(*(to_device(t, device) for t in (ids, lengths, pad, real)))


def to_device(t: torch.Tensor, device: Any) -> torch.Tensor:
    """A host tensor on `device`; to CUDA through pinned memory, asynchronously (the host does not wait)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def make_blocks(batch: Batch, block_size: int, mask_id: int, weights: torch.Tensor):
    """Block inputs, labels, weights and the training `Span`, one row per sequence.

    Returns block_ids [b, n*B], labels [b, n*B], w [b, n*B], span (q over each row's n*B block slots).
    """
    ids, b = batch.ids, block_size
    rows, t = ids.shape
    pos, w = _slot_weights(batch, weights)  # [rows, n, B] each
    labels = ids.gather(1, pos.clamp(max=t - 1).flatten(1)).view_as(pos)
    block = torch.full_like(pos, mask_id)
    block[..., 0] = ids.gather(1, batch.anchors)
    n = pos.shape[1]
    span = Span(
        q_pos=pos.flatten(1),
        ctx_pos=torch.arange(t, device=ids.device),
        q_limit=batch.anchors[..., None].expand(-1, -1, b).flatten(1),  # context strictly before the anchor
        q_segment=torch.arange(n, device=ids.device).repeat_interleave(b),  # [n*B]: no block sees another
    )
    return block.flatten(1), labels.flatten(1), w.flatten(1), span


def _slot_weights(batch: Batch, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block slot's position and loss weight, pos and w [rows, n, B]: padding blocks and slots past
    the end of their sequence weigh 0 (slot 0 already does)."""
    pos = batch.anchors[..., None] + torch.arange(len(weights), device=batch.ids.device)  # [rows, n, B]
    valid = (pos < batch.lengths[:, None, None]) & batch.real[..., None]
    return pos, weights.to(batch.ids.device) * valid


def weight_sum(batch: Batch, weights: torch.Tensor) -> torch.Tensor:
    """The sum of a batch's slot weights (a device scalar): what its loss is normalised by."""
    return _slot_weights(batch, weights)[1].sum()


class LossOut(NamedTuple):
    """A loss and its statistics, all tensors (reading them syncs the device: the trainer does it rarely)."""

    loss: torch.Tensor  # weighted mean CE over supervised slots
    tau: torch.Tensor  # teacher-forced acceptance estimate over real blocks
    supervised: torch.Tensor  # number of slots with a positive weight


def dflash_loss(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    w: torch.Tensor,
    real: torch.Tensor,
    rows: int | None,
) -> LossOut:
    """The DFlash loss from the drafter's states hidden [R, n*B, H]; labels, w [R, n, B]; real [R, n].

    Slots 1..B-1 of every block are selected by shape (no data-dependent indexing, so no device sync);
    padding blocks and slots past the end carry weight 0. tau: 1 + the accepted prefix if the argmax drafts
    were verified against the labels, averaged over real blocks. `head`: states -> drafter logits.
    """
    h, gold, w1 = supervised_slots(hidden, labels, w)
    total, hits = head_loss(head, h, gold, w1, rows)
    return summarize(total, hits, w, real)


def supervised_slots(
    hidden: torch.Tensor, labels: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots 1..B-1 of every block, by shape: states [M, H], labels [M], weights [M] (M = R * n * (B - 1))."""
    r, n, b = labels.shape
    h = hidden.view(r, n, b, -1)[:, :, 1:].reshape(r * n * (b - 1), -1)  # [M, H]
    return h, labels[:, :, 1:].reshape(-1), w[:, :, 1:].reshape(-1).float()


def summarize(total: torch.Tensor, hits: torch.Tensor, w: torch.Tensor, real: torch.Tensor) -> LossOut:
    """A `LossOut` from a weighted loss sum and the argmax hits [M] of slots 1..B-1 (w [R, n, B], real [R, n])."""
    r, n, b = w.shape
    w1 = w[:, :, 1:].reshape(-1)  # [M]
    loss = total / w1.sum().clamp(min=1e-12)
    with torch.no_grad():
        hit = hits.view(r * n, b - 1) & (w[:, :, 1:].reshape(r * n, b - 1) > 0)
        runs = 1 + hit.long().cumprod(1).sum(1).float()  # [R*n]
        keep = real.flatten().float()
        tau = (runs * keep).sum() / keep.sum().clamp(min=1)
    return LossOut(loss, tau, (w1 > 0).sum())


def block_loss(
    module: Any,
    adapter: Any,
    batch: Batch,
    feats: torch.Tensor,
    mask_id: int,
    weights: torch.Tensor,
    head_rows: int | None = None,
    loss_fn: Callable[..., LossOut] = dflash_loss,
) -> LossOut:
    """Weighted CE over every block of a batch in one drafter call. feats [b, T, K*H].

    `module(emb, feats, span)` returns the final-norm states (a `TrainingDrafter`, DDP-wrapped or not, or
    a bare drafter); `loss_fn` turns them into a `LossOut` (per drafter architecture).
    """
    from dflash_zoo.training.forward import bare_drafter, block_embeddings, logits_fn

    b = len(weights)
    block, labels, w, span = make_blocks(batch, b, mask_id, weights)
    drafter = bare_drafter(module)
    emb = block_embeddings(drafter, adapter, block)  # [rows, n*B, H]
    dtype = _compute_dtype(drafter, emb.device)
    h = module(emb.to(dtype), feats.to(dtype), span)  # [rows, n*B, H]
    rows, n = batch.anchors.shape
    head = logits_fn(drafter, adapter)
    return loss_fn(h, head, labels.view(rows, n, b), w.view(rows, n, b), batch.real, head_rows)


def _compute_dtype(module: Any, device: torch.device) -> torch.dtype:
    """Inputs in the autocast dtype when autocast is on (no fp32 copies of bf16 features), else the weights'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(module.parameters()).dtype


def lr_factor(progress: float, warmup: float) -> float:
    """Linear warmup to 1 over `warmup` of training, then cosine to 0."""
    if progress < warmup:
        return progress / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / max(1e-8, 1 - warmup))))
