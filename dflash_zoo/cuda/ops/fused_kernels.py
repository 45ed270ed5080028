"""The Triton kernels of fused.py (imported on first use, so that importing fused.py needs no triton),
and `slices_sum`, which the sandwich kernel shares."""

import triton
import triton.language as tl

from dflash_zoo.cuda.ops.launch_kernels import allow_next, wait_previous


@triton.jit
def slices_sum(P, at, mask, splits, plane, U: tl.constexpr = 4):
    """fp32 partial sums at offsets `at` of `splits` slices `plane` elements apart (a split-K GEMV's
    [splits, rows, n]), added in order; U slices' loads in flight at once (unrolled)."""
    acc = tl.zeros(at.shape, tl.float32)
    for s0 in range(0, splits, U):
        for s1 in tl.static_range(U):
            acc += tl.load(P + (s0 + s1) * plane + at, mask=mask & (at * 0 + s0 + s1 < splits), other=0.0)
    return acc


@triton.jit
def rope_store(QKV, QW, KW, Cos, Sin, Pos, Q, K, V, rows, width, keys, heads, kvh, hd, rot, eps, qspan,
               offset, splits, D: tl.constexpr, NORM: tl.constexpr, FP32_WEIGHT: tl.constexpr, V_NORM: tl.constexpr,
               K_EQ_V: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr = 0):  # fmt: skip
    allow_next(PDL)
    wait_previous(PDL)
    t, j = tl.program_id(0), tl.program_id(1)  # row; head slot: q heads, then k heads, then v heads
    d = tl.arange(0, D)
    dok = d < hd
    col = tl.where(j < heads, j * qspan, heads * qspan + (j - heads) * hd)  # q heads may span [query | gate]
    if K_EQ_V:  # no v projection: a V head reads its K head's columns
        col = tl.where(j >= heads + kvh, col - kvh * hd, col)
    dt = Q.dtype.element_ty
    if PARTS:  # a split-K GEMV's fp32 partial sums [splits, rows, width]: summed in order, rounded (`gemv`'s)
        x = slices_sum(QKV, t * width + col + d, dok, splits, rows * width).to(dt)
    else:
        x = tl.load(QKV + t * width + col + d, mask=dok, other=0.0)
    pos = tl.load(Pos + t)
    if j >= heads + kvh:  # a V head: stored as it is, or RMSNorm'd without a weight (fp32, rounded once)
        if V_NORM:
            xf = x.to(tl.float32)
            x = (xf / tl.sqrt(tl.sum(xf * xf, 0) / hd + eps)).to(x.dtype)
        tl.store(V + ((j - heads - kvh) * keys + pos) * hd + d, x, mask=dok)
    else:
        half = rot // 2
        pd = tl.where(d < half, d + half, d - half)  # rotate_half's partner of each rotated dim
        if PARTS:
            xp = slices_sum(QKV, t * width + col + pd, dok & (d < rot), splits, rows * width).to(dt)
        else:
            xp = tl.load(QKV + t * width + col + pd, mask=dok & (d < rot), other=0.0)
        xf, xpf = x.to(tl.float32), xp.to(tl.float32)
        if NORM:  # the q/k norm in the declared formula (as `rms_norm`), per head
            r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hd + eps)
            if j < heads:
                w = tl.load(QW + d, mask=dok, other=0.0).to(tl.float32)
                wp = tl.load(QW + pd, mask=dok, other=0.0).to(tl.float32)
            else:
                w = tl.load(KW + d, mask=dok, other=0.0).to(tl.float32)
                wp = tl.load(KW + pd, mask=dok, other=0.0).to(tl.float32)
            if FP32_WEIGHT:  # normed * (offset + weight) in fp32, rounded once
                xf = (xf * r * (w + offset)).to(x.dtype).to(tl.float32)
                xpf = (xpf * r * (wp + offset)).to(x.dtype).to(tl.float32)
            else:  # Llama: the norm rounded to the dtype, then the weight product
                xf = ((xf * r).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
                xpf = ((xpf * r).to(x.dtype).to(tl.float32) * wp).to(x.dtype).to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded; dims past `rot` pass (cos 1, sin 0)
        c = tl.load(Cos + t * rot + d, mask=d < rot, other=1.0).to(tl.float32)
        s = tl.load(Sin + t * rot + d, mask=d < rot, other=0.0).to(tl.float32)
        a = (xf * c).to(x.dtype).to(tl.float32)
        b = (xpf * s).to(x.dtype).to(tl.float32)
        y = (a + tl.where(d < half, -b, b)).to(x.dtype)
        if j < heads:
            tl.store(Q + (j * rows + t) * hd + d, y, mask=dok)
        else:
            tl.store(K + ((j - heads) * keys + pos) * hd + d, y, mask=dok)


@triton.jit
def rms_norm(X, Dl, Dm, B, W, G, S, Y, n, splits, more, eps, offset, post, D: tl.constexpr,
             FP32_WEIGHT: tl.constexpr, GATED: tl.constexpr, ADD: tl.constexpr, PARTS: tl.constexpr,
             MORE: tl.constexpr, BIAS: tl.constexpr, POST: tl.constexpr, PDL: tl.constexpr = 0):  # fmt: skip
    allow_next(PDL)
    wait_previous(PDL)
    row, d = tl.program_id(0), tl.arange(0, D)
    ok = d < n
    x = tl.load(X + row * n + d, mask=ok, other=0.0)
    if ADD:  # x + delta first (the residual sum, rounded as torch's add), written to S, then its norm
        if PARTS:  # a split-K GEMV's fp32 partial sums [splits, rows, n]: added in order, plus bias, rounded
            acc = slices_sum(Dl, row * n + d, ok, splits, tl.num_programs(0) * n)
            if MORE:  # a second group of partial sums [more, rows, n] (a shared expert's), after the first
                for sp in range(0, more):
                    acc += tl.load(Dm + (sp * tl.num_programs(0) + row) * n + d, mask=ok, other=0.0)
            if BIAS:
                acc += tl.load(B + d, mask=ok, other=0.0).to(tl.float32)
            delta = acc.to(x.dtype)
        else:
            delta = tl.load(Dl + row * n + d, mask=ok, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
        tl.store(S + row * n + d, x, mask=ok)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(W + d, mask=ok, other=0.0).to(tl.float32)
    if FP32_WEIGHT:  # (normed * (offset + weight)) in fp32, rounded once
        y = (xf * r * (w + offset)).to(x.dtype)
    else:  # Llama: the norm rounded to the dtype, then the weight product
        y = ((xf * r).to(x.dtype).to(tl.float32) * w).to(x.dtype)
    if GATED:  # times silu(gate) in fp32, rounded once (Qwen3.5's gated norm)
        g = tl.load(G + row * n + d, mask=ok, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * (g / (1.0 + tl.exp(-g)))).to(x.dtype)
    if POST:  # then times a constant, rounded (Gemma 4's router input)
        y = (y.to(tl.float32) * post).to(x.dtype)
    tl.store(Y + row * n + d, y, mask=ok)


@triton.jit
def silu_mul(G, U, Y, n, g_stride, u_stride, BLOCK: tl.constexpr):
    row, cols = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(G + row * g_stride + cols, mask=ok, other=0.0)
    u = tl.load(U + row * u_stride + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu, rounded as torch's
    tl.store(Y + row * n + cols, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)
