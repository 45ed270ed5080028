"""Grouped-query attention over static K/V buffers, for the static engine's target and drafter.

Every function takes q [1, h, T, d], k, v [1, kvh, S, d] and an additive mask [1, 1, g*T, S] (`_group_mask`)
and returns [1, T, h*d]. GQA runs as extra query rows ([1, kvh, g*T, d], head h = kv_head * g + i, rows
ordered (i, t)) so no kernel needs repeated K/V. Sliding windows are part of the mask; sinks need their own
softmax (`_grouped_sinks`, or the split kernel's merge).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_zoo.cuda.ops import attention_kernels as kernels


def _ungroup(out: torch.Tensor, h: int, t: int) -> torch.Tensor:
    """[1, kvh, g*T, d] grouped query rows (head h = kv_head * g + i, rows ordered (i, t)) -> [1, T, h*d]."""
    return out.reshape(1, h, t, out.shape[-1]).transpose(1, 2).reshape(1, t, -1)


def _grouped_sdpa(q, k, v, gmask, scale: float) -> torch.Tensor:
    """q [1, h, T, d]; k, v [1, kvh, S, d]; gmask [1, 1, g*T, S] additive (`_group_mask`) -> [1, T, h*d].

    GQA as extra query rows ([1, kvh, g*T, d]) so the masked kernel needs no repeated K/V.
    """
    _, h, t, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(1, kvh, (h // kvh) * t, d)  # head h = kv_head * g + i, rows ordered (i, t)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=gmask, scale=scale)
    return _ungroup(out, h, t)


def _grouped_sums(q, k, v, gmask, scale: float) -> torch.Tensor:
    """`_grouped_sdpa` as explicit products and sums. For compiled steps only (eager would materialise
    [kvh, g*T, S, d]): inductor makes each sum one reduction kernel spread over every key.
    """
    _, h, t, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(1, kvh, (h // kvh) * t, 1, d)  # same row order as `_grouped_sdpa`
    scores = (qg * k[:, :, None]).sum(-1, dtype=torch.float32) * scale + gmask  # [1, kvh, g*T, S]
    p = scores.softmax(-1).to(v.dtype)
    out = (p[..., None] * v[:, :, None]).sum(-2)  # [1, kvh, g*T, d]
    return _ungroup(out, h, t)


def _grouped_chunks(q, k, v, gmask, scale: float, chunks: int = 16) -> torch.Tensor:
    """`_grouped_sums` split over key chunks (flash-decoding): per chunk a max, a sum of exponentials and a
    partial output, then one weighted combine; each reduction then has `chunks` times the rows. Compiled only.
    """
    _, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    c = chunks if s % chunks == 0 else 1
    rows = (h // kvh) * t
    qg = q.reshape(1, kvh, rows, 1, 1, d)  # same row order as `_grouped_sdpa`
    kc, vc = k.view(1, kvh, 1, c, s // c, d), v.view(1, kvh, 1, c, s // c, d)
    scores = (qg * kc).sum(-1, dtype=torch.float32) * scale + gmask.view(1, 1, rows, c, s // c)  # [.., c, L]
    # a chunk with every key hidden has max -inf: clamped, its exponentials are 0 and its weight too (no NaN)
    m = scores.amax(-1, keepdim=True).clamp(min=-1e30)  # [1, kvh, rows, c, 1]
    e = (scores - m).exp()
    part = (e[..., None] * vc).sum(-2)  # [1, kvh, rows, c, d]
    w = (m - m.amax(-2, keepdim=True)).exp()  # [1, kvh, rows, c, 1]: each chunk's share of the global max
    out = (w * part).sum(-2) / (w * e.sum(-1, keepdim=True)).sum(-2)  # [1, kvh, rows, d]
    return _ungroup(out.to(v.dtype), h, t)


def _grouped_split(q, k, v, gmask, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`_grouped_sdpa` through the Triton split-KV kernel (`kernels.split_kv_attention`); CUDA only. With
    sinks [h], `_grouped_sinks`' softmax (the merge kernel adds each row's sink to the denominator)."""
    _, h, t, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(kvh, (h // kvh) * t, d)  # same row order as `_grouped_sdpa`
    if sinks is not None:  # head h = kv_head * g + i: one sink per grouped row, rows ordered (i, t)
        sinks = sinks.float().view(kvh, h // kvh, 1).expand(-1, -1, t).reshape(kvh, -1)
    return kernels.split_kv_attention(qg, k[0], v[0], gmask[0, 0], scale, sinks, tokens=t).reshape(1, t, -1)


# one-row (autoregressive) attention of the static target. At T = 1 the masked SDPA kernel runs one block per
# KV head (8 blocks on 132 SMs for Qwen3-8B: 28 us a layer on an H200); "chunks" beat "sums" inside a compiled
# 8B step (187 against 173 tok/s on one H200); "split" (kernels.py) is 7.4 us alone and the fastest compiled
# and not (docs/performance.md, "How the fast path works").
DECODE_ATTENTION = {
    "sdpa": _grouped_sdpa,
    "sums": _grouped_sums,
    "chunks": _grouped_chunks,
    "split": _grouped_split,
}
# multi-row attention: the target's verify and the drafter's block (explicit sums lose there;
# docs/performance.md)
BLOCK_ATTENTION = {"sdpa": _grouped_sdpa, "split": _grouped_split}


def _grouped_sinks(q, k, v, gmask, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """`_grouped_sdpa` with a learned per-head logit joined to each softmax row and then dropped (gpt-oss
    sinks: some probability mass goes nowhere), as explicit products. sinks [h] -> out [1, T, h*d]."""
    _, h, t, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(1, kvh, (h // kvh) * t, d)  # same row order as `_grouped_sdpa`
    scores = (qg @ k.transpose(-1, -2)) * scale + gmask  # [1, kvh, g*T, S]
    sink = sinks.view(kvh, h // kvh, 1).expand(-1, -1, t).reshape(1, kvh, -1, 1).to(scores.dtype)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(-1, keepdim=True)  # as transformers' eager path (finite: the sink is)
    p = logits.softmax(-1)[..., :-1].to(v.dtype)  # the sink's share is dropped
    return _ungroup(p @ v, h, t)


def _group_mask(mask: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S] bool -> [1, 1, g*T, S] additive (0 / -inf) in `dtype`: `_grouped_sdpa`'s query rows.

    Built once per forward; SDPA would otherwise turn a bool mask into this on every layer's call.
    """
    add = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return add.repeat(g, 1)[None, None]
