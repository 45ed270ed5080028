"""Grouped-query attention over static K/V buffers: torch forms and the split-KV Triton kernel.

Every `grouped_*` function takes q [1, h, T, d], k, v [1, kvh, S, d] and an additive mask [1, 1, g*T, S]
(`group_mask`) and returns [1, T, h*d]. GQA runs as extra query rows ([1, kvh, g*T, d], head h = kv_head * g + i,
rows ordered (i, t)) so no kernel needs repeated K/V. Sliding windows are part of the mask; sinks need their own
softmax (`grouped_sinks`, or the split kernel's merge). `grouped_sdpa` is the reference the others equal.

`split_kv_attention` (the Triton kernels of attention_kernels.py), why: at one query row per head (an
autoregressive step) the masked SDPA kernel runs one block per KV head: 8 blocks on an H200's 132 SMs for
Qwen3-8B, ~28 us a layer to read ~4.7 MB of K/V (docs/performance.md). Here each program takes one KV head and
one chunk of keys (~2 programs per SM), all the head's query rows at once (GQA rows share the K/V tile), and a
second kernel merges the chunks' partial softmaxes. Same masked semantics as `grouped_sdpa`: an additive mask
row per query row; key tiles hidden from every row are skipped. It is a torch custom op, so `torch.compile`
sees one opaque call and CUDA graphs capture the launches; it runs on CUDA, or under Triton's interpreter.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dflash_zoo.cuda.ops.runtime import launch_mode, pow2, sms

TILE = 32  # keys per inner iteration
MAX_CHUNKS = 64  # partial results per (head, row) that the merge kernel reads at once
PROGRAMS_PER_SM = 2  # target (KV head, chunk) programs per SM; tile rounding lands between half and all of it
# largest [query rows x head dim] accumulator of one program: 128 x 128 fits an H200's shared memory, 128 x 512
# (8:1 GQA x 16 rows of Gemma 4's global layers) needs 528 KB and fails to compile
MAX_ACCUMULATOR = 128 * 128


def chunking(keys: int, heads: int, sms: int) -> tuple[int, int]:
    """(keys per chunk, chunks): whole tiles, at most MAX_CHUNKS chunks, ~PROGRAMS_PER_SM programs per SM."""
    want = max(1, min(MAX_CHUNKS, -(-PROGRAMS_PER_SM * sms // heads)))
    size = TILE * -(-keys // (want * TILE))
    return size, -(-keys // size)


@functools.cache
def _kernels():
    from dflash_zoo.cuda.ops import attention_kernels as k  # triton on first use only

    return k.partial, k.merge


@torch.library.custom_op("dflash_zoo::split_kv_attention", mutates_args=())
def split_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    tokens: int = 0,
) -> torch.Tensor:
    """q [kvh, rows, d] (a head's GQA query rows); k, v [kvh, S, d]; bias [rows, S] additive -> [kvh, rows, d].
    sinks [kvh, rows]: a logit per query row joined to its softmax and then dropped (gpt-oss). With `tokens` T
    (rows = g T, ordered (i, t)): the output token-major instead, [T, kvh g, d], as the next projection reads it
    (no copy to reorder it)."""
    kvh, rows, hd = q.shape
    step = max(1, MAX_ACCUMULATOR // pow2(hd))  # rows per launch: the [rows, d] fp32 tile must fit on chip
    if pow2(rows) * pow2(hd) > MAX_ACCUMULATOR and rows > step:  # e.g. Gemma 4's 512-wide global heads
        parts = [slice(r, min(rows, r + step)) for r in range(0, rows, step)]
        out = torch.cat(
            [
                split_kv_attention(q[:, p], k, v, bias[p], scale, None if sinks is None else sinks[:, p])
                for p in parts
            ],
            dim=1,
        )
        if tokens:  # [kvh, (i, t), hd] -> [t, (kvh, i), hd]
            out = out.view(-1, tokens, hd).transpose(0, 1).contiguous()
        return out
    keys = k.shape[1]
    q, k, v, bias = q.contiguous(), k.contiguous(), v.contiguous(), bias.contiguous()
    big_r, big_d = pow2(rows), pow2(hd)
    chunk, n_chunks = chunking(keys, kvh, sms(q))
    f32 = dict(device=q.device, dtype=torch.float32)
    pm, pl = torch.empty(kvh, n_chunks, big_r, **f32), torch.empty(kvh, n_chunks, big_r, **f32)
    po = torch.empty(kvh, n_chunks, big_r, big_d, **f32)
    out = q.new_empty(tokens, kvh * rows // tokens, hd) if tokens else torch.empty_like(q)
    partial, merge = _kernels()[:2]
    ieee = q.dtype == torch.float32
    warps = 4 if big_r * big_d <= 8192 else 8  # e.g. 8:1 GQA x 16-row blocks: a [128, 128] fp32 accumulator
    mode = launch_mode(q)  # both kernels launch alike
    meta = dict(R=big_r, D=big_d, N=TILE, IEEE=ieee, num_warps=warps, **mode)
    partial[(kvh, n_chunks)](q, k, v, bias, po, pm, pl, scale, rows, keys, hd, chunk, n_chunks, **meta)
    s = sinks.contiguous() if sinks is not None else pm  # unread without SINK
    merge[(kvh, rows)](
        po, pm, pl, s, out, rows, hd, n_chunks, max(tokens, 1), R=big_r, D=big_d, C=pow2(n_chunks, 1),
        SINK=sinks is not None, UNGROUP=tokens > 0, **mode,
    )  # fmt: skip
    return out


@split_kv_attention.register_fake
def _(q, k, v, bias, scale, sinks=None, tokens=0):
    kvh, rows, hd = q.shape
    return q.new_empty(tokens, kvh * rows // tokens, hd) if tokens else torch.empty_like(q)


def _ungroup(out: torch.Tensor, h: int, t: int) -> torch.Tensor:
    """[1, kvh, g*T, d] grouped query rows (head h = kv_head * g + i, rows ordered (i, t)) -> [1, T, h*d]."""
    return out.reshape(1, h, t, out.shape[-1]).transpose(1, 2).reshape(1, t, -1)


def grouped_sdpa(q, k, v, gmask, scale: float) -> torch.Tensor:
    """q [1, h, T, d]; k, v [1, kvh, S, d]; gmask [1, 1, g*T, S] additive (`group_mask`) -> [1, T, h*d].

    GQA as extra query rows ([1, kvh, g*T, d]) so the masked kernel needs no repeated K/V.
    """
    _, h, t, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(1, kvh, (h // kvh) * t, d)  # head h = kv_head * g + i, rows ordered (i, t)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=gmask, scale=scale)
    return _ungroup(out, h, t)


def grouped_sums(q, k, v, gmask, scale: float) -> torch.Tensor:
    """`grouped_sdpa` as explicit products and sums. For compiled steps only (eager would materialise
    [kvh, g*T, S, d]): inductor makes each sum one reduction kernel spread over every key.
    """
    _, h, t, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(1, kvh, (h // kvh) * t, 1, d)  # same row order as `grouped_sdpa`
    scores = (qg * k[:, :, None]).sum(-1, dtype=torch.float32) * scale + gmask  # [1, kvh, g*T, S]
    p = scores.softmax(-1).to(v.dtype)
    out = (p[..., None] * v[:, :, None]).sum(-2)  # [1, kvh, g*T, d]
    return _ungroup(out, h, t)


def grouped_chunks(q, k, v, gmask, scale: float, chunks: int = 16) -> torch.Tensor:
    """`grouped_sums` split over key chunks (flash-decoding): per chunk a max, a sum of exponentials and a
    partial output, then one weighted combine; each reduction then has `chunks` times the rows. Compiled only.
    """
    _, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    c = chunks if s % chunks == 0 else 1
    rows = (h // kvh) * t
    qg = q.reshape(1, kvh, rows, 1, 1, d)  # same row order as `grouped_sdpa`
    kc, vc = k.view(1, kvh, 1, c, s // c, d), v.view(1, kvh, 1, c, s // c, d)
    scores = (qg * kc).sum(-1, dtype=torch.float32) * scale + gmask.view(1, 1, rows, c, s // c)  # [.., c, L]
    # a chunk with every key hidden has max -inf: clamped, its exponentials are 0 and its weight too (no NaN)
    m = scores.amax(-1, keepdim=True).clamp(min=-1e30)  # [1, kvh, rows, c, 1]
    e = (scores - m).exp()
    part = (e[..., None] * vc).sum(-2)  # [1, kvh, rows, c, d]
    w = (m - m.amax(-2, keepdim=True)).exp()  # [1, kvh, rows, c, 1]: each chunk's share of the global max
    out = (w * part).sum(-2) / (w * e.sum(-1, keepdim=True)).sum(-2)  # [1, kvh, rows, d]
    return _ungroup(out.to(v.dtype), h, t)


def grouped_split(q, k, v, gmask, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`grouped_sdpa` through the Triton split-KV kernel (`split_kv_attention`); CUDA only. With
    sinks [h], `grouped_sinks`' softmax (the merge kernel adds each row's sink to the denominator)."""
    _, h, t, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(kvh, (h // kvh) * t, d)  # same row order as `grouped_sdpa`
    if sinks is not None:  # head h = kv_head * g + i: one sink per grouped row, rows ordered (i, t)
        sinks = sinks.float().view(kvh, h // kvh, 1).expand(-1, -1, t).reshape(kvh, -1)
    return split_kv_attention(qg, k[0], v[0], gmask[0, 0], scale, sinks, tokens=t).reshape(1, t, -1)


# one-row (autoregressive) attention of the static target. At T = 1 the masked SDPA kernel runs one block per
# KV head (8 blocks on 132 SMs for Qwen3-8B: 28 us a layer on an H200); "chunks" beat "sums" inside a compiled
# 8B step (187 against 173 tok/s on one H200); "split" (`split_kv_attention`) is 7.4 us alone and the fastest
# compiled and not (docs/performance.md, "How the fast path works").
DECODE_ATTENTION = {
    "sdpa": grouped_sdpa,
    "sums": grouped_sums,
    "chunks": grouped_chunks,
    "split": grouped_split,
}
# multi-row attention: the target's verify and the drafter's block (explicit sums lose there;
# docs/performance.md)
BLOCK_ATTENTION = {"sdpa": grouped_sdpa, "split": grouped_split}


def grouped_sinks(q, k, v, gmask, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """`grouped_sdpa` with a learned per-head logit joined to each softmax row and then dropped (gpt-oss
    sinks: some probability mass goes nowhere), as explicit products. sinks [h] -> out [1, T, h*d]."""
    _, h, t, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(1, kvh, (h // kvh) * t, d)  # same row order as `grouped_sdpa`
    scores = (qg @ k.transpose(-1, -2)) * scale + gmask  # [1, kvh, g*T, S]
    sink = sinks.view(kvh, h // kvh, 1).expand(-1, -1, t).reshape(1, kvh, -1, 1).to(scores.dtype)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.amax(-1, keepdim=True)  # as transformers' eager path (finite: the sink is)
    p = logits.softmax(-1)[..., :-1].to(v.dtype)  # the sink's share is dropped
    return _ungroup(p @ v, h, t)


def group_mask(mask: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S] bool -> [1, 1, g*T, S] additive (0 / -inf) in `dtype`: `grouped_sdpa`'s query rows.

    Built once per forward; SDPA would otherwise turn a bool mask into this on every layer's call.
    """
    add = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return add.repeat(g, 1)[None, None]
