"""DFlash 2's selector objective: a k-way cross-entropy over each slot's candidates, teacher-forced.

Recipe (speculators `models/dflash2/metrics.py`, PR #1006, adapted from z-lab 07ebd93; SpecForge PR #772 names
the weight `dflash2_selector_loss_alpha`):
- the candidates of a slot are the top-k of its drafter logits (the set the selector sees when drafting),
  taken without gradient; when the gold token is not among them it replaces the weakest candidate
  ("gold-token injection"), so every supervised slot has a k-way label;
- the predecessor of slot t is the gold token of slot t-1 (the block's first token for slot 1): teacher forcing,
  where drafting uses the selector's own previous choice;
- a candidate's score is its drafter logit (with gradient) plus the selector's transition score, so the loss
  trains the drafter's logits and the selector together;
- the per-slot weights are the DFlash decay weights of the unary loss; the total is
  unary + alpha * selector (alpha = 1 by default in speculators).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash_zoo.drafters.dflash2 import CandidateSelector
from dflash_zoo.training.blocks import LossOut, summarize, supervised_slots
from dflash_zoo.training.head_loss import chunked_loss, default_rows


def training_candidates(cands: torch.Tensor, gold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cands [M, k] top-k ids, gold [M] -> (candidates with the gold id injected at rank k-1 where it was
    missing, the gold's position in them [M])."""
    k = cands.shape[-1]
    hit = cands.eq(gold[:, None])  # [M, k]
    present = hit.any(-1)
    pos = torch.where(present, hit.long().argmax(-1), torch.full_like(gold, k - 1))
    last = torch.where(present, cands[:, -1], gold)
    return torch.cat([cands[:, :-1], last[:, None]], dim=-1), pos


def selector_loss(
    selector: CandidateSelector,
    h: torch.Tensor,
    logits: torch.Tensor,
    prev: torch.Tensor,
    gold: torch.Tensor,
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, H] final states and logits [M, V] of M slots, prev [M] their teacher-forced predecessors, gold [M]
    labels, w [M] weights -> (the weighted sum of the k-way cross-entropy, the weighted count of slots whose
    gold token is among the drafter's own top-k before injection: the selector's reachable share)."""
    with torch.no_grad():
        raw = logits.topk(selector.top_k, dim=-1).indices  # [M, k]
        cands, pos = training_candidates(raw, gold)
        reachable = (raw.eq(gold[:, None]).any(-1).float() * w).sum()
    code = selector.predecessor_codebook[prev] * selector.hidden_projection(h).to(
        selector.predecessor_codebook.dtype
    )
    trans = (selector.successor_codebook[cands] * code[:, None, :]).sum(-1)  # [M, k]
    scores = logits.gather(-1, cands).float() + trans.float()
    ce = F.cross_entropy(scores, pos, reduction="none")  # [M]
    return (ce * w).sum(), reachable


def predecessors(labels: torch.Tensor) -> torch.Tensor:
    """labels [..., B] (slot k: the token at anchor + k; slot 0 is the anchor's own token) -> [..., B - 1]: the
    teacher-forced predecessor of slots 1..B-1 (the anchor for slot 1, then the gold token of slot t - 1)."""
    return labels[..., :-1]


def dflash2_loss(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    w: torch.Tensor,
    real: torch.Tensor,
    rows: int | None,
    *,
    selector: CandidateSelector,
    alpha: float,
) -> LossOut:
    """The DFlash 2 loss from the drafter's states hidden [R, n*B, H]; labels, w [R, n, B]; real [R, n]: the
    DFlash loss (weighted CE of slots 1..B-1) plus `alpha` times the selector's, both normalised by the
    weights' sum. One pass of the LM head per chunk serves both (chunked: the logits never exist at once)."""
    h, gold, w1 = supervised_slots(hidden, labels, w)  # [M, H], [M], [M]
    prev = predecessors(labels).reshape(-1)  # [M]

    def part(x: torch.Tensor, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(x).float()  # [m, V]
        unary = (F.cross_entropy(logits, gold[s:e], reduction="none") * w1[s:e]).sum()
        sel, _ = selector_loss(selector, x, logits, prev[s:e], gold[s:e], w1[s:e])
        return unary + alpha * sel, logits.detach().argmax(-1) == gold[s:e]

    params = tuple(p for p in selector.parameters() if p.requires_grad)
    total, hits = chunked_loss(part, h, rows or default_rows(head, h), params)
    return summarize(total, hits, w, real)
