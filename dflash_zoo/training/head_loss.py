"""Weighted cross-entropy through the target's LM head, in chunks: the [M, V] logits never exist at once.

`head_loss(head, h, labels, w)` returns sum_i w_i * CE(head(h_i), label_i) and, per row, whether the argmax
equals the label; `chunked_loss` runs any such per-chunk loss (DFlash 2 adds its selector's, selector_loss.py). The forward runs chunk by chunk: logits of one chunk (in the head's dtype, log-softmax in
fp32), their weighted CE, and at once the gradient of that CE with respect to the chunk's inputs (autograd
through `head`, so soft-capping or any other adapter logic is differentiated as written). Only that input
gradient [M, H] is kept for the backward, which scales it by the incoming gradient: the LM head costs one
forward and one input-gradient GEMM per slot, and a chunk's logits are freed before the next. The head's own
parameters are frozen and get no gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk


def chunk_rows(vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's fp32 logits take about `budget` bytes."""
    return max(1, budget // (4 * vocab))


class _Chunked(torch.autograd.Function):
    """sum over chunks of `part(x_chunk, start, end)`, with the gradients of each chunk taken at once (with
    respect to its input rows and to `params`), so no chunk's logits outlive its turn."""

    @staticmethod
    def forward(ctx, part, rows, h, *params):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h)  # [M, H]
        grads = [torch.zeros_like(p) for p in params]
        hits = torch.empty(h.shape[0], dtype=torch.bool, device=h.device)
        for s in range(0, h.shape[0], rows):
            e = min(s + rows, h.shape[0])
            x = h[s:e].detach().requires_grad_(True)
            with torch.enable_grad():
                loss, hit = part(x, s, e)  # loss: 0-d fp32; hit [m] bool (argmax == label)
            got = torch.autograd.grad(loss, [x, *params], allow_unused=True)
            grad[s:e] = got[0]
            for acc, g in zip(grads, got[1:], strict=True):
                if g is not None:
                    acc += g
            total += loss.detach()
            hits[s:e] = hit
            del loss
        ctx.save_for_backward(grad, *grads)
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, g_total, _g_hits):
        grad, *grads = ctx.saved_tensors
        return None, None, grad * g_total.to(grad.dtype), *(g * g_total.to(g.dtype) for g in grads)


def chunked_loss(
    part: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]],
    h: torch.Tensor,
    rows: int,
    params: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sum of `part` over row chunks of h [M, H], argmax hits [M]); `part(x, start, end)` returns the loss
    of rows start:end (x those rows, with gradient) and their hits. `params`: tensors `part` uses that need
    gradients too (the head's own are frozen)."""
    return _Chunked.apply(part, rows, h, *params)


def head_loss(
    head: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    labels: torch.Tensor,
    w: torch.Tensor,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE sum, argmax hits [M]) of h [M, H] against labels [M] with weights w [M].

    Args:
        head: h -> logits (the drafter's logits through the target's LM head).
        rows: rows per chunk (default: about 1 GB of fp32 logits).
    """
    w = w.float()

    def part(x: torch.Tensor, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(x).float()  # [m, V]
        loss = (F.cross_entropy(logits, labels[s:e], reduction="none") * w[s:e]).sum()
        return loss, logits.detach().argmax(-1) == labels[s:e]

    return chunked_loss(part, h, rows or default_rows(head, h))


def default_rows(head: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> int:
    """Rows per chunk for about 1 GB of fp32 logits, whatever the head's vocabulary."""
    return chunk_rows(head(h[:1].detach()).shape[-1])
