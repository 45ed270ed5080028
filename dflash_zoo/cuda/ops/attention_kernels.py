"""Triton kernels for the static path's few-row steps: split-KV attention (the projections: gemv.py; the
elementwise work between them: fused_ops.py).

Why: at one query row per head (an autoregressive step) the masked SDPA kernel runs one block per KV head: 8
blocks on an H200's 132 SMs for Qwen3-8B, ~28 us a layer to read ~4.7 MB of K/V (docs/performance.md). Here
each program takes one KV head and one chunk of keys (~2 programs per SM), all the head's query rows at once
(GQA rows share the K/V tile), and a second kernel merges the chunks' partial softmaxes. Same masked semantics
as `attention._grouped_sdpa`: an additive mask row per query row; key tiles hidden from every row are skipped.

It is a torch custom op, so `torch.compile` sees one opaque call and CUDA graphs capture the launches. It
runs on CUDA, or anywhere under Triton's interpreter (`TRITON_INTERPRET=1`, CPU tests). Triton is imported on
first use only.
"""

from __future__ import annotations

import functools
import os

import torch

TILE = 32  # keys per inner iteration
MAX_CHUNKS = 64  # partial results per (head, row) that the merge kernel reads at once
PROGRAMS_PER_SM = 2  # target (KV head, chunk) programs per SM; tile rounding lands between half and all of it
# largest [query rows x head dim] accumulator of one program: 128 x 128 fits an H200's shared memory, 128 x 512
# (8:1 GQA x 16 rows of Gemma 4's global layers) needs 528 KB and fails to compile
MAX_ACCUMULATOR = 128 * 128


def available(device: torch.device) -> str | None:
    """None when the kernels can run on `device`, else why not."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernels need a CUDA device (got {device.type})"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the Triton kernels need the `triton` package"
    return None


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def chunking(keys: int, heads: int, sms: int) -> tuple[int, int]:
    """(keys per chunk, chunks): whole tiles, at most MAX_CHUNKS chunks, ~PROGRAMS_PER_SM programs per SM."""
    want = max(1, min(MAX_CHUNKS, -(-PROGRAMS_PER_SM * sms // heads)))
    size = TILE * -(-keys // (want * TILE))
    return size, -(-keys // size)


@functools.cache
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(t: torch.Tensor) -> int:
    """SMs of the tensor's GPU (8 under the interpreter: only the chunking depends on it)."""
    return _sms_of(t.device.index or 0) if t.is_cuda else 8


@functools.cache
def _kernels():
    """Compile-on-first-use Triton kernels (imported here so that importing this module needs no triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def partial(Q, K, V, Bias, PO, PM, PL, scale, rows, keys, hd, chunk, n_chunks,
                R: tl.constexpr, D: tl.constexpr, N: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        h, c = tl.program_id(0), tl.program_id(1)  # KV head, key chunk
        r, d = tl.arange(0, R), tl.arange(0, D)
        rok, dok = r < rows, d < hd
        q = tl.load(
            Q + (h * rows + r[:, None]) * hd + d[None, :], mask=rok[:, None] & dok[None, :], other=0.0
        )
        m_i = tl.full([R], float("-inf"), tl.float32)  # running max per row
        l_i = tl.zeros([R], tl.float32)  # running sum of exponentials per row
        acc = tl.zeros([R, D], tl.float32)  # running un-normalised output per row
        for start in range(c * chunk, c * chunk + chunk, N):
            n = start + tl.arange(0, N)
            nok = n < keys
            bias = tl.load(
                Bias + r[:, None] * keys + n[None, :], mask=rok[:, None] & nok[None, :], other=float("-inf")
            )
            bias = bias.to(tl.float32)  # [R, N]
            if tl.max(tl.max(bias, 1), 0) > float("-inf"):  # a tile hidden from every row costs no K/V read
                kv = (h * keys + n[:, None]) * hd + d[None, :]
                kvok = nok[:, None] & dok[None, :]
                k = tl.load(K + kv, mask=kvok, other=0.0)  # [N, D]
                if IEEE:  # fp32 inputs: exact products, not TF32
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale + bias  # [R, N]
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # rows still fully hidden keep max -inf: subtract 0 instead, so exp(-inf) = 0, never NaN
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)  # rescale of what was summed under the old max
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + kv, mask=kvok, other=0.0)
                if IEEE:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        at = (h * n_chunks + c) * R + r  # [R] slots of this (head, chunk)
        tl.store(PM + at, m_i)
        tl.store(PL + at, l_i)
        tl.store(PO + at[:, None] * D + d[None, :], acc)

    @triton.jit
    def merge(PO, PM, PL, Sinks, Out, rows, hd, n_chunks, tokens, R: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
              SINK: tl.constexpr, UNGROUP: tl.constexpr):  # fmt: skip
        h, row = tl.program_id(0), tl.program_id(1)
        c, d = tl.arange(0, C), tl.arange(0, D)
        cok = c < n_chunks
        at = (h * n_chunks + c) * R + row  # [C]
        m = tl.load(PM + at, mask=cok, other=float("-inf"))
        top = tl.max(m, 0)
        if SINK:  # the row's sink logit joins the softmax (its share of the mass goes nowhere)
            sink = tl.load(Sinks + h * rows + row).to(tl.float32)
            top = tl.maximum(top, sink)
        w = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))  # each chunk's share of the global max
        total = tl.sum(w * tl.load(PL + at, mask=cok, other=0.0), 0)
        if SINK:
            total += tl.exp(sink - top)
        part = tl.load(PO + at[:, None] * D + d[None, :], mask=cok[:, None], other=0.0)  # [C, D]
        out = tl.sum(w[:, None] * part, 0) / total
        if UNGROUP:  # grouped row (i, t) of KV head h is query head h * g + i of token t: [tokens, heads, hd]
            g = rows // tokens
            at_out = ((row % tokens) * tl.num_programs(0) * g + h * g + row // tokens) * hd + d
        else:
            at_out = (h * rows + row) * hd + d
        tl.store(Out + at_out, out.to(Out.dtype.element_ty), mask=d < hd)

    return partial, merge


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
    step = max(1, MAX_ACCUMULATOR // _pow2(hd))  # rows per launch: the [rows, d] fp32 tile must fit on chip
    if _pow2(rows) * _pow2(hd) > MAX_ACCUMULATOR and rows > step:  # e.g. Gemma 4's 512-wide global heads
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
    big_r, big_d = _pow2(rows), _pow2(hd)
    chunk, n_chunks = chunking(keys, kvh, _sms(q))
    f32 = dict(device=q.device, dtype=torch.float32)
    pm, pl = torch.empty(kvh, n_chunks, big_r, **f32), torch.empty(kvh, n_chunks, big_r, **f32)
    po = torch.empty(kvh, n_chunks, big_r, big_d, **f32)
    out = q.new_empty(tokens, kvh * rows // tokens, hd) if tokens else torch.empty_like(q)
    partial, merge = _kernels()[:2]
    ieee = q.dtype == torch.float32
    warps = 4 if big_r * big_d <= 8192 else 8  # e.g. 8:1 GQA x 16-row blocks: a [128, 128] fp32 accumulator
    meta = dict(R=big_r, D=big_d, N=TILE, IEEE=ieee, num_warps=warps)
    partial[(kvh, n_chunks)](q, k, v, bias, po, pm, pl, scale, rows, keys, hd, chunk, n_chunks, **meta)
    s = sinks.contiguous() if sinks is not None else pm  # unread without SINK
    merge[(kvh, rows)](
        po, pm, pl, s, out, rows, hd, n_chunks, max(tokens, 1), R=big_r, D=big_d, C=_pow2(n_chunks, 1),
        SINK=sinks is not None, UNGROUP=tokens > 0,
    )  # fmt: skip
    return out


@split_kv_attention.register_fake
def _(q, k, v, bias, scale, sinks=None, tokens=0):
    kvh, rows, hd = q.shape
    return q.new_empty(tokens, kvh * rows // tokens, hd) if tokens else torch.empty_like(q)
