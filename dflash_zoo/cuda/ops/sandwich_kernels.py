"""The Triton kernel of sandwich.py (imported on first use, so that importing sandwich.py needs no triton)."""

import triton
import triton.language as tl

from dflash_zoo.cuda.ops.fused_kernels import slices_sum


@triton.jit
def delta_row(P, row, rows, n, d, ok, splits, PARTS: tl.constexpr):
    """A sublayer's output row in fp32: its GEMV's partial sums [splits, rows, n] added in order (eight slices'
    loads in flight at once), or the row of a [rows, n] tensor."""
    if PARTS:
        return slices_sum(P, row * n + d, ok, splits, rows * n, 8)
    return tl.load(P + row * n + d, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def rstd(v, n, eps):
    """1 / RMS of fp32 values v [D] (n of them real)."""
    return 1.0 / tl.sqrt(tl.sum(v * v, 0) / n + eps)


@triton.jit
def scaled(v, r, W, d, ok, offset, dtype, FP32_WEIGHT: tl.constexpr):
    """The RMSNorm of v given its 1 / RMS r, with weight W, rounded to the dtype (fp32 again)."""
    w = tl.load(W + d, mask=ok, other=0.0).to(tl.float32)
    if FP32_WEIGHT:
        return (v * r * (w + offset)).to(dtype).to(tl.float32)
    return ((v * r).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@triton.jit
def sandwich_add(X, D1, W1, D2, W2, WO, Sc, N1, N2, N3, S, Y, rows, n, s1, s2, eps, offset, post,
                 D: tl.constexpr, FP32_WEIGHT: tl.constexpr, PARTS1: tl.constexpr, PARTS2: tl.constexpr,
                 TWO: tl.constexpr, OUTER: tl.constexpr, SCALAR: tl.constexpr, NORMS: tl.constexpr,
                 LAST_LLAMA: tl.constexpr):  # fmt: skip
    row, d = tl.program_id(0), tl.arange(0, D)
    ok = d < n
    # every input first, so that their loads are in flight together; each sublayer output rounded to the dtype
    x = tl.load(X + row * n + d, mask=ok, other=0.0)
    dt = x.dtype
    a = delta_row(D1, row, rows, n, d, ok, s1, PARTS1).to(dt).to(tl.float32)
    if TWO:  # a second branch beside it, normed on its own, then the two summed (rounded)
        b = delta_row(D2, row, rows, n, d, ok, s2, PARTS2).to(dt).to(tl.float32)
        ra, rb = rstd(a, n, eps), rstd(b, n, eps)
        a = scaled(a, ra, W1, d, ok, offset, dt, FP32_WEIGHT) + scaled(
            b, rb, W2, d, ok, offset, dt, FP32_WEIGHT
        )
        a = a.to(dt).to(tl.float32)
    else:
        a = scaled(a, rstd(a, n, eps), W1, d, ok, offset, dt, FP32_WEIGHT)
    if OUTER:
        a = scaled(a, rstd(a, n, eps), WO, d, ok, offset, dt, FP32_WEIGHT)
    xf = (x.to(tl.float32) + a).to(dt).to(tl.float32)
    if SCALAR:
        xf = (xf * tl.load(Sc).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(S + row * n + d, xf.to(dt), mask=ok)
    r = rstd(xf, n, eps)  # one reduction for every norm of the new residual
    for j in tl.static_range(NORMS):
        if j == 0:
            W = N1
        elif j == 1:
            W = N2
        else:
            W = N3
        if LAST_LLAMA and j == NORMS - 1:  # Llama's formula, then a constant (rounded)
            y = (scaled(xf, r, W, d, ok, 0.0, dt, False) * post).to(dt)
        else:
            y = scaled(xf, r, W, d, ok, offset, dt, FP32_WEIGHT).to(dt)
        tl.store(Y + (j * rows + row) * n + d, y, mask=ok)
