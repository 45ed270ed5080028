"""The Triton kernels of gdn.py (imported on first use, so that importing gdn.py needs no triton): a Gated-DeltaNet
layer's causal conv with its gates, the conv window's commit, and the gated delta rule over a few rows in place.

The delta rule (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", arXiv 2412.06464), per value head with
state S [Dk, Dv], for each row t: S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t, with
q and k L2-normalised and q scaled by Dk^-1/2 (as transformers' and flash-linear-attention's kernels do)."""

import triton
import triton.language as tl


@triton.jit
def conv_input(X, x_stride, Win, src, c, mask, KS: tl.constexpr, ZERO: tl.constexpr):
    """The conv input at positions `src` [R] of channels `c` [BC]: new rows where src >= 0, else window slot
    KS - 1 + src (the K - 1 inputs before the first new row); ZERO: an empty (all-zero) window."""
    new = src >= 0
    x = tl.load(X + src[:, None] * x_stride + c[None, :], mask=mask & new[:, None], other=0.0)
    if ZERO:
        return x
    w = tl.load(
        Win + c[None, :] * (KS - 1) + (src + KS - 1)[:, None], mask=mask & (src < 0)[:, None], other=0.0
    )
    return tl.where(new[:, None], x, w.to(x.dtype))


@triton.jit
def shift_window(X, x_stride, Win, n, c, cok, KS: tl.constexpr, WS: tl.constexpr, ZERO: tl.constexpr):
    """Window slot s of channels c <- the conv input at position n + s - (KS - 1) (n new rows consumed)."""
    s = tl.arange(0, WS)
    m = (s < KS - 1)[:, None] & cok[None, :]
    x = conv_input(X, x_stride, Win, n + s - (KS - 1), c, m, KS, ZERO)  # [WS, BC], all read before any write
    tl.debug_barrier()
    tl.store(Win + c[None, :] * (KS - 1) + s[:, None], x.to(Win.dtype.element_ty), mask=m)


@triton.jit
def conv_gates(X, x_stride, Win, W, Bias, Out, B, b_stride, A, a_stride, ALog, DtBias, G, Beta, rows, C, kd, hv,
               KS: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, WS: tl.constexpr, HP: tl.constexpr,
               BIAS: tl.constexpr, ZERO: tl.constexpr, STORE: tl.constexpr):  # fmt: skip
    """Rows [rows, C] -> silu(causal depthwise conv) as q | k | v, each [rows, width] contiguous, in one flat
    Out; program (c, 0) also the log decay G and gate Beta [rows, hv] of its row block; STORE: the window takes
    the last KS - 1 conv inputs (one row block only, or ZERO: nothing reads the old window)."""
    pc, pr = tl.program_id(0), tl.program_id(1)  # channel block, row block
    c, t = pc * BC + tl.arange(0, BC), pr * R + tl.arange(0, R)
    cok, tok = c < C, t < rows
    ok = tok[:, None] & cok[None, :]
    acc = tl.zeros([R, BC], tl.float32)
    for j in tl.static_range(KS):  # tap j weighs the input KS - 1 - j rows before row t (causal)
        x = conv_input(X, x_stride, Win, t + j - (KS - 1), c, ok, KS, ZERO)
        acc += x.to(tl.float32) * tl.load(W + c * KS + j, mask=cok, other=0.0).to(tl.float32)[None, :]
    if BIAS:
        acc += tl.load(Bias + c, mask=cok, other=0.0).to(tl.float32)[None, :]
    dtype = Out.dtype.element_ty
    y = acc.to(dtype).to(tl.float32)  # the conv's output in the dtype, then SiLU rounded to it, as torch does
    y = (y / (1.0 + tl.exp(-y))).to(dtype)
    part = (c >= kd).to(tl.int32) + (c >= 2 * kd).to(tl.int32)  # 0: q, 1: k, 2: v
    width = tl.where(part == 2, C - 2 * kd, kd)
    tl.store(
        Out + part[None, :] * rows * kd + t[:, None] * width[None, :] + (c - part * kd)[None, :], y, mask=ok
    )
    if pc == 0:  # g = -exp(A_log) * softplus(a + dt_bias) in fp32; beta = sigmoid(b) in the dtype
        h = tl.arange(0, HP)
        m = tok[:, None] & (h < hv)[None, :]
        a = tl.load(A + t[:, None] * a_stride + h[None, :], mask=m, other=0.0).to(tl.float32)
        a += tl.load(DtBias + h, mask=h < hv, other=0.0).to(tl.float32)[None, :]
        soft = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's softplus threshold
        g = -tl.exp(tl.load(ALog + h, mask=h < hv, other=0.0).to(tl.float32))[None, :] * soft
        tl.store(G + t[:, None] * hv + h[None, :], g, mask=m)
        b = tl.load(B + t[:, None] * b_stride + h[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(
            Beta + t[:, None] * hv + h[None, :], (1.0 / (1.0 + tl.exp(-b))).to(Beta.dtype.element_ty), mask=m
        )
    if STORE and pr == 0:
        shift_window(X, x_stride, Win, rows, c, cok, KS, WS, ZERO)


@triton.jit
def window_commit(X, x_stride, Win, N, C, KS: tl.constexpr, BC: tl.constexpr, WS: tl.constexpr):
    """After a verify of rows X: the window moves past the first N (read on device) of them."""
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    shift_window(X, x_stride, Win, tl.load(N), c, c < C, KS, WS, False)


@triton.jit
def delta_rule(Q, K, V, G, Beta, State, Out, N, rows, hk, hv, dk, dv, scale,
               DK: tl.constexpr, BV: tl.constexpr, COUNT: tl.constexpr, OUT: tl.constexpr,
               STORE: tl.constexpr):  # fmt: skip
    """Rows [0, n) (n = rows, or read from N with COUNT) of q, k [rows, hk, dk], v [rows, hv, dv], g, beta
    [rows, hv] through the rule from State [hv, dk, dv] (fp32); STORE: the final state back into State; OUT:
    o [rows, hv, dv]. One program per (value tile, value head); value head h reads key head h // (hv // hk)."""
    pv, h = tl.program_id(0), tl.program_id(1)
    kh = h // (hv // hk)
    i, e = tl.arange(0, DK), pv * BV + tl.arange(0, BV)
    iok, eok = i < dk, e < dv
    at = State + h * dk * dv + i[:, None] * dv + e[None, :]
    s = tl.load(at, mask=iok[:, None] & eok[None, :], other=0.0)  # [DK, BV]
    n = tl.load(N) if COUNT else rows
    for t in tl.range(0, n):
        k = tl.load(K + (t * hk + kh) * dk + i, mask=iok, other=0.0).to(tl.float32)
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        v = tl.load(V + (t * hv + h) * dv + e, mask=eok, other=0.0).to(tl.float32)
        beta = tl.load(Beta + t * hv + h).to(tl.float32)
        s *= tl.exp(tl.load(G + t * hv + h))
        u = beta * (v - tl.sum(s * k[:, None], 0))  # [BV]: the value's error against what S recalls for k
        s += k[:, None] * u[None, :]
        if OUT:
            q = tl.load(Q + (t * hk + kh) * dk + i, mask=iok, other=0.0).to(tl.float32)
            q = q * scale / tl.sqrt(tl.sum(q * q) + 1e-6)
            o = tl.sum(s * q[:, None], 0)
            tl.store(Out + (t * hv + h) * dv + e, o.to(Out.dtype.element_ty), mask=eok)
    if STORE:
        tl.store(at, s, mask=iok[:, None] & eok[None, :])
