"""The Triton kernels of attention.py (imported on first use, so that importing attention.py needs no triton):
`partial`, one program per (KV head, chunk of keys) over all of the head's query rows, and `merge`, which
combines the chunks' partial softmaxes (with a sink logit per row where asked)."""

import triton
import triton.language as tl

from dflash_zoo.cuda.ops.launch_kernels import allow_next, wait_previous


@triton.jit
def partial(Q, K, V, Bias, PO, PM, PL, scale, rows, keys, hd, chunk, n_chunks,
            R: tl.constexpr, D: tl.constexpr, N: tl.constexpr, IEEE: tl.constexpr,
            PDL: tl.constexpr = 0):  # fmt: skip
    allow_next(PDL)
    wait_previous(PDL)
    h, c = tl.program_id(0), tl.program_id(1)  # KV head, key chunk
    r, d = tl.arange(0, R), tl.arange(0, D)
    rok, dok = r < rows, d < hd
    q = tl.load(Q + (h * rows + r[:, None]) * hd + d[None, :], mask=rok[:, None] & dok[None, :], other=0.0)
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
          SINK: tl.constexpr, UNGROUP: tl.constexpr, PDL: tl.constexpr = 0):  # fmt: skip
    allow_next(PDL)
    wait_previous(PDL)
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
