"""DFlash 2's selector objective (training/selector_loss.py): gold-token injection, scores equal to the drafting
walk's, gradients reach the drafter's logits and the selector, and a few steps lower it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_zoo.drafters.dflash2 import CandidateSelector
from dflash_zoo.engine.config import normalize_draft_config
from dflash_zoo.training.selector_loss import predecessors, selector_loss, training_candidates
from tests.tiny import dflash2_config, tiny_target


def test_gold_token_injection():
    cands = torch.tensor([[5, 3, 9, 1], [7, 2, 8, 4]])
    out, pos = training_candidates(cands, torch.tensor([9, 6]))
    assert out.tolist() == [[5, 3, 9, 1], [7, 2, 8, 6]] and pos.tolist() == [2, 3]


def test_predecessors_are_teacher_forced():
    labels = torch.tensor([[[10, 11, 12, 13]]])  # slot 0: the anchor's token
    assert predecessors(labels).tolist() == [[[10, 11, 12]]]


def selector():
    cfg = normalize_draft_config(dflash2_config(tiny_target("qwen3", seed=0)))
    torch.manual_seed(0)
    sel = CandidateSelector(cfg)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(0, 0.5)
    return sel, cfg


def test_scores_are_the_drafting_walks_and_gradients_flow():
    sel, cfg = selector()
    h = torch.randn(6, cfg.hidden_size)
    logits = torch.randn(6, cfg.vocab_size, requires_grad=True)
    prev, gold = torch.randint(0, cfg.vocab_size, (6,)), torch.randint(0, cfg.vocab_size, (6,))
    w = torch.rand(6)
    total, _ = selector_loss(sel, h, logits, prev, gold, w)
    # the same k-way cross-entropy from the walk's own score function, slot by slot
    cands, pos = training_candidates(logits.detach().topk(sel.top_k, -1).indices, gold)
    expected = sum(
        w[i]
        * F.cross_entropy(
            sel.scores(
                prev[i], logits[i, cands[i]], sel.successor_codebook[cands[i]], sel.hidden_projection(h[i])
            )[None],
            pos[i : i + 1],
        )  # fmt: skip
        for i in range(6)
    )
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)
    total.backward()
    assert logits.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in sel.parameters())


def test_a_few_steps_lower_the_loss():
    sel, cfg = selector()
    h = torch.randn(32, cfg.hidden_size)
    logits = torch.randn(32, cfg.vocab_size)
    prev, gold = (
        torch.randint(0, cfg.vocab_size, (32,)),
        logits.topk(3, -1).indices[:, 2],
    )  # gold always reachable
    opt = torch.optim.Adam(sel.parameters(), lr=0.05)
    first = None
    for _ in range(30):
        opt.zero_grad()
        loss, reachable = selector_loss(sel, h, logits, prev, gold, torch.ones(32))
        loss.backward()
        opt.step()
        first = float(loss.detach()) if first is None else first
    assert float(reachable) == 32 and float(loss.detach()) < 0.5 * first
