"""The Triton kernels of moe.py (imported on first use, so that importing moe.py needs no triton): the routing
rule, the one-token expert GEMV and the several-token grouped expert kernel, which share `expert_input`."""

import triton
import triton.language as tl

from dflash_zoo.cuda.ops.fused_kernels import slices_sum
from dflash_zoo.cuda.ops.gemv_kernels import activation


@triton.jit
def expert_input(xr, cols, mask, k_in, limit, alpha, ACT: tl.constexpr):
    """A projection's input at `cols` of the rows at `xr`; ACT 1 to 3: the declared activation of a gate/up
    output [.., 2 k_in], each op rounded to the dtype as torch rounds it."""
    if ACT == 1 or ACT == 3:  # act(gate) * up over [gate | up] halves: SiLU, or GELU's tanh form
        u = tl.load(xr + k_in + cols, mask=mask, other=0.0)
        g = tl.load(xr + cols, mask=mask, other=0.0).to(tl.float32)
        x = (activation(g, ACT).to(u.dtype).to(tl.float32) * u.to(tl.float32)).to(u.dtype)
    elif ACT == 2:  # interleaved gate/up, both clamped; (up + 1) * gate * sigmoid(alpha * gate)
        u = tl.load(xr + 2 * cols + 1, mask=mask, other=0.0)
        g = tl.load(xr + 2 * cols, mask=mask, other=0.0)
        dt = u.dtype
        gf = tl.minimum(g.to(tl.float32), limit).to(dt).to(tl.float32)
        uf = tl.maximum(tl.minimum(u.to(tl.float32), limit), -limit).to(dt).to(tl.float32)
        sg = (1.0 / (1.0 + tl.exp(-(gf * alpha).to(dt).to(tl.float32)))).to(dt).to(tl.float32)
        x = ((uf + 1.0).to(dt).to(tl.float32) * (gf * sg).to(dt).to(tl.float32)).to(dt)
    else:
        x = tl.load(xr + cols, mask=mask, other=0.0)
    return x


@triton.jit
def expert_gemv(X, W, Bias, Idx, RW, Out, n_out, k_in, per_row, x_stride, s_e, s_n, s_k, top_k, limit, alpha,
                BN: tl.constexpr, BK: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr,
                WEIGHTED: tl.constexpr):  # fmt: skip
    s, pn = tl.program_id(0), tl.program_id(1)  # (token, expert) pair, output rows
    e = tl.load(Idx + s).to(tl.int64)
    xr = X + (s // per_row) * x_stride  # the pair's input row
    rows = pn * BN + tl.arange(0, BN)
    rok = rows < n_out
    acc = tl.zeros([BN, BK], tl.float32)
    for k0 in range(0, k_in, BK):
        cols = k0 + tl.arange(0, BK)
        cok = cols < k_in
        x = expert_input(xr, cols, cok, k_in, limit, alpha, ACT)
        w = tl.load(
            W + e * s_e + rows[:, None] * s_n + cols[None, :] * s_k,
            mask=rok[:, None] & cok[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    dtype = X.dtype.element_ty
    y = tl.sum(acc, 1).to(dtype)  # rounded as a GEMM's output, then the bias added
    if BIAS:
        b = tl.load(Bias + e * n_out + rows, mask=rok, other=0.0)
        y = (y.to(tl.float32) + b.to(tl.float32)).to(dtype)
    if WEIGHTED:  # times the routing weight (rounded), into slice j of [k, tokens, N] for pair (t, j)
        y = (y.to(tl.float32) * tl.load(RW + s).to(tl.float32)).to(dtype)
        tokens = tl.num_programs(0) // top_k
        tl.store(Out + ((s % top_k) * tokens + s // top_k) * n_out + rows, y.to(tl.float32), mask=rok)
    else:
        tl.store(Out + s * n_out + rows, y, mask=rok)


@triton.jit
def expert_gemm(X, W, Bias, Idx, RW, Out, n_out, k_in, pairs, per_row, x_stride, s_e, s_n, s_k, top_k, limit,
                alpha, R: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BIAS: tl.constexpr,
                ACT: tl.constexpr, WEIGHTED: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """Several rows: one program per (expert, output tile) runs every pair routed to its expert at once on the
    tensor cores, so each expert's weights are read once; experts no pair chose exit at once."""
    e, pn = tl.program_id(0), tl.program_id(1)
    sp = tl.arange(0, SP)
    hit = (tl.load(Idx + sp, mask=sp < pairs, other=-1) == e).to(tl.int32)  # [SP] pairs of this expert
    count = tl.sum(hit, 0)
    if count > 0:
        rank = tl.sum(hit[None, :] * (sp[None, :] < sp[:, None]).to(tl.int32), 1)  # [SP] earlier hits
        r = tl.arange(0, R)
        pair = tl.sum(tl.where((hit[None, :] > 0) & (rank[None, :] == r[:, None]), sp[None, :], 0), 1)  # [R]
        rok = r < count
        xr = X + (pair // per_row)[:, None] * x_stride  # [R, 1] each row's input
        n = pn * BN + tl.arange(0, BN)
        nok = n < n_out
        acc = tl.zeros([R, BN], tl.float32)
        for k0 in range(0, k_in, BK):
            cols = (k0 + tl.arange(0, BK))[None, :]
            xm = rok[:, None] & (cols < k_in)
            x = expert_input(xr, cols, xm, k_in, limit, alpha, ACT)  # [R, BK]
            w = tl.load(
                W + e * s_e + n[:, None] * s_n + cols * s_k, mask=nok[:, None] & (cols < k_in), other=0.0
            )
            if IEEE:  # fp32 inputs: exact products, not TF32
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))  # [R, BN]
        dtype = X.dtype.element_ty
        y = acc.to(dtype)
        if BIAS:
            y = y.to(tl.float32) + tl.load(Bias + e * n_out + n, mask=nok, other=0.0).to(tl.float32)[None, :]
            y = y.to(dtype)
        ok = rok[:, None] & nok[None, :]
        if WEIGHTED:
            y = (y.to(tl.float32) * tl.load(RW + pair, mask=rok, other=0.0).to(tl.float32)[:, None]).to(dtype)
            at = ((pair % top_k) * (pairs // top_k) + pair // top_k)[:, None] * n_out + n[None, :]
            tl.store(Out + at, y.to(tl.float32), mask=ok)
        else:
            tl.store(Out + pair[:, None] * n_out + n[None, :], y, mask=ok)


@triton.jit
def route(L, Sc, Wt, Ix, n_exp, top_k, splits, E: tl.constexpr, KP: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
          RENORM: tl.constexpr, SCALED: tl.constexpr, PARTS: tl.constexpr):  # fmt: skip
    t, e = tl.program_id(0), tl.arange(0, E)
    ok = e < n_exp
    if PARTS:  # the router GEMV's fp32 partial sums: added in order, rounded to the dtype (the scales')
        score = slices_sum(L, t * n_exp + e, ok, splits, tl.num_programs(0) * n_exp).to(Sc.dtype.element_ty)
        score = tl.where(ok, score.to(tl.float32), float("-inf"))
    else:
        score = tl.load(L + t * n_exp + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:  # softmax over every expert in fp32; the top k of the probabilities
        p = tl.exp(score - tl.max(score, 0))
        score = tl.where(ok, p / tl.sum(p, 0), float("-inf"))
    j = tl.arange(0, KP)
    vals = tl.zeros([KP], tl.float32)
    idx = tl.zeros([KP], tl.int32)
    for r in range(top_k):  # the largest left, the lowest index among equals; in descending order as topk
        best = tl.max(score, 0)
        arg = tl.min(tl.where(score == best, e, E), 0)
        vals = tl.where(j == r, best, vals)
        idx = tl.where(j == r, arg, idx)
        score = tl.where(e == arg, float("-inf"), score)
    kok = j < top_k
    if SOFTMAX_FIRST:
        if RENORM:  # in fp32, then rounded to the logits' dtype
            vals = vals / tl.sum(tl.where(kok, vals, 0.0), 0)
    else:  # a softmax over the top k logits, rounded once
        ex = tl.where(kok, tl.exp(vals - tl.max(tl.where(kok, vals, float("-inf")), 0)), 0.0)
        vals = ex / tl.sum(ex, 0)
    if SCALED:  # times each chosen expert's scale, in fp32 (Wt is then fp32)
        vals *= tl.load(Sc + idx, mask=kok, other=0.0).to(tl.float32)
    tl.store(Wt + t * top_k + j, vals.to(Wt.dtype.element_ty), mask=kok)
    tl.store(Ix + t * top_k + j, idx.to(tl.int64), mask=kok)
