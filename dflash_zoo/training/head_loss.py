"""Weighted cross-entropy through the target's LM head, in chunks: the [M, V] logits never exist at once.

`head_loss(head, h, labels, w)` returns sum_i w_i * CE(head(h_i), label_i) and, per row, whether the argmax
equals the label. The forward runs chunk by chunk: logits of one chunk (in the head's dtype, log-softmax in
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


class _ChunkedHeadCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, labels, w, head, rows):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad = torch.empty_like(h)  # [M, H]
        hits = torch.empty(h.shape[0], dtype=torch.bool, device=h.device)
        for s in range(0, h.shape[0], rows):
            e = min(s + rows, h.shape[0])
            x = h[s:e].detach().requires_grad_(True)
            with torch.enable_grad():
                logits = head(x).float()  # [m, V]
                part = (F.cross_entropy(logits, labels[s:e], reduction="none") * w[s:e]).sum()
            (grad[s:e],) = torch.autograd.grad(part, x)
            total += part.detach()
            hits[s:e] = logits.detach().argmax(-1) == labels[s:e]
            del logits, part
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, g_total, _g_hits):
        (grad,) = ctx.saved_tensors
        return grad * g_total.to(grad.dtype), None, None, None, None


def head_loss(
    head: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    labels: torch.Tensor,
    w: torch.Tensor,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE sum, argmax hits [M]) of h [M, H] against labels [M] with weights w [M].

    Args:
        head: h -> logits (the adapter's `logits`: LM head, soft-capping included).
        rows: rows per chunk (default: about 1 GiB of fp32 logits).
    """
    if rows is None:
        probe = head(h[:1].detach())  # [1, V]: the vocabulary size, whatever the head is
        rows = chunk_rows(probe.shape[-1])
    return _ChunkedHeadCE.apply(h, labels, w.float(), head, rows)
