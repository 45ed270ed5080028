"""The Triton kernels of gemv.py (imported on first use, so that importing gemv.py needs no triton), the
gated activations they and the expert kernels (moe_kernels.py) compute, and the one-row GEMV that fp8.py runs
too (`BLOCKS`: an FP8 weight and its block scales)."""

import torch
import triton
import triton.language as tl

from dflash_zoo.cuda.ops.fused_kernels import slices_sum
from dflash_zoo.cuda.ops.launch_kernels import allow_next, wait_previous

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def activation(g, ACT: tl.constexpr):
    """fp32 g -> act(g) in fp32: SiLU (ACT 1), or GELU's tanh form (ACT 3) as g sigmoid(2u), u = sqrt(2 / pi)
    (g + 0.044715 g^3), which is 0.5 g (1 + tanh(u))."""
    if ACT == 3:
        return g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))
    return g / (1.0 + tl.exp(-g))


@triton.jit
def gemv_input(X, Gate, cols, cok, in_splits, in_plane, dtype, ACT: tl.constexpr, IN_PARTS: tl.constexpr):
    """One row's input at `cols`: x, or HF's act_fn(gate) * x, the activation and the product each rounded to
    the dtype as torch rounds them. IN_PARTS: x and gate are the fp32 partial sums of the GEMV that made them
    ([in_splits, 1, K] slices `in_plane` apart), each summed in order and rounded to the dtype first."""
    if IN_PARTS:
        x = slices_sum(X, cols, cok, in_splits, in_plane).to(dtype)
    else:
        x = tl.load(X + cols, mask=cok, other=0.0)
    if ACT:
        if IN_PARTS:
            g = slices_sum(Gate, cols, cok, in_splits, in_plane).to(dtype).to(tl.float32)
        else:
            g = tl.load(Gate + cols, mask=cok, other=0.0).to(tl.float32)
        x = (activation(g, ACT).to(x.dtype).to(tl.float32) * x.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def scaled_input(X, Gate, s_row, k0, cols, cok, k_in, in_splits, in_plane, DT: tl.constexpr, BK: tl.constexpr,
                 ACT: tl.constexpr, IN_PARTS: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
    """`gemv_input` at `cols` (BK from k0); with BLOCKS (an FP8 weight) each column times its 128 x 128 block's
    scale, so the e4m3 weights multiply it as they are."""
    x = gemv_input(X, Gate, cols, cok, in_splits, in_plane, DT, ACT, IN_PARTS)
    if BLOCKS:
        if BK <= 128:  # BK divides 128: one block, one scalar load
            x *= tl.load(s_row + tl.minimum(k0, k_in - 1) // 128)
        else:
            x *= tl.load(s_row + tl.minimum(cols, k_in - 1) // 128)  # [BK]
    return x


@triton.jit
def gemv_part(W, S, X, Gate, Scale, Part, n_out, k_in, k_split, s_stride, in_splits, in_plane,
              DT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr, SCALE: tl.constexpr,
              BLOCKS: tl.constexpr, PREFETCH: tl.constexpr, IN_PARTS: tl.constexpr,
              ROW_SUMS: tl.constexpr = 0, PDL: tl.constexpr = 0):  # fmt: skip
    """Rows [BN] of W x over one K slice -> their fp32 partial sums. DT: the activations' dtype (a gated or
    summed input's rounding). BLOCKS: W is float8_e4m3fn with fp32 scales S per 128 x 128 block (rows
    `s_stride` apart; BN divides 128). PREFETCH: each iteration issues the next weight tile's load before it
    multiplies the current one, so two tiles are in flight per program. ROW_SUMS (not with PREFETCH): each
    iteration reduces its products to [BN] row sums, a [BN] accumulator in place of [BN, BK] (fewer registers:
    more programs per SM; 3-6% faster on the FP8 GEMVs of an 8B shape, one H100). PDL: the slice's first
    weight tile is loaded before waiting for the previous kernel (`runtime.launch_mode`)."""
    allow_next(PDL)
    pn, ps = tl.program_id(0), tl.program_id(1)  # output rows, K slice
    rows = pn * BN + tl.arange(0, BN)
    rok = rows < n_out
    w_rows = W + rows[:, None] * k_in
    s_row = S + (pn * BN // 128) * s_stride  # the tile's row of scale blocks (BLOCKS)
    k_lo, k_hi = ps * k_split, ps * k_split + k_split
    acc = tl.zeros([BN] if ROW_SUMS else [BN, BK], tl.float32)
    if PREFETCH:
        cols = k_lo + tl.arange(0, BK)
        w = tl.load(w_rows + cols[None, :], mask=rok[:, None] & (cols < k_in)[None, :], other=0.0)
        wait_previous(PDL)
        for k0 in range(k_lo, k_hi, BK):
            cols = k0 + tl.arange(0, BK)
            nxt = cols + BK
            w_next = tl.load(w_rows + nxt[None, :], mask=rok[:, None] & ((nxt < k_in) & (nxt < k_hi))[None, :],
                             other=0.0)  # fmt: skip
            x = scaled_input(X, Gate, s_row, k0, cols, cols < k_in, k_in, in_splits, in_plane, DT, BK, ACT,
                             IN_PARTS, BLOCKS)  # fmt: skip
            acc += w.to(tl.float32) * x[None, :]
            w = w_next
    else:
        for k0 in range(k_lo, k_hi, BK):
            cols = k0 + tl.arange(0, BK)
            cok = cols < k_in
            w = tl.load(w_rows + cols[None, :], mask=rok[:, None] & cok[None, :], other=0.0)
            if k0 == k_lo:  # the first tile's weights in flight, then the input may be read
                wait_previous(PDL)
            x = scaled_input(X, Gate, s_row, k0, cols, cok, k_in, in_splits, in_plane, DT, BK, ACT, IN_PARTS,
                             BLOCKS)  # fmt: skip
            if ROW_SUMS:
                acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
            else:
                acc += w.to(tl.float32) * x[None, :]
    y = acc if ROW_SUMS else tl.sum(acc, 1)
    if SCALE:  # times sigmoid(logit), rounded to the dtype as torch's sigmoid (a shared expert's gate)
        logit = tl.load(Scale)
        y *= (1.0 / (1.0 + tl.exp(-logit.to(tl.float32)))).to(logit.dtype).to(tl.float32)
    tl.store(Part + ps * n_out + rows, y, mask=rok)


@triton.jit
def gemm_part(W, X, Gate, Part, Bias, n_rows, n_out, k_in, k_split, x_stride, g_stride,
              R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr, DIRECT: tl.constexpr,
              BIAS: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """A few rows (R >= 16, padded): [rows, K] x [N, K]^T over one tile of N and one slice of K, on the
    tensor cores. DIRECT (one slice): the output itself, plus bias, in the input dtype."""
    pn, ps = tl.program_id(0), tl.program_id(1)  # output columns, K slice
    n = pn * BN + tl.arange(0, BN)
    r = tl.arange(0, R)
    nok, rok = n < n_out, r < n_rows
    acc = tl.zeros([R, BN], tl.float32)
    for k0 in range(ps * k_split, ps * k_split + k_split, BK):
        cols = k0 + tl.arange(0, BK)
        cok = cols < k_in
        xm = rok[:, None] & cok[None, :]
        x = tl.load(X + r[:, None] * x_stride + cols[None, :], mask=xm, other=0.0)  # [R, BK]
        if ACT:  # as gemv_part: act(gate) * up, each op rounded to the dtype
            g = tl.load(Gate + r[:, None] * g_stride + cols[None, :], mask=xm, other=0.0).to(tl.float32)
            x = (activation(g, ACT).to(x.dtype).to(tl.float32) * x.to(tl.float32)).to(x.dtype)
        w = tl.load(W + n[:, None] * k_in + cols[None, :], mask=nok[:, None] & cok[None, :], other=0.0)
        if IEEE:  # fp32 inputs: exact products, not TF32
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))  # [R, BN]
    at = r[:, None] * n_out + n[None, :]
    ok = rok[:, None] & nok[None, :]
    if DIRECT:
        if BIAS:
            acc += tl.load(Bias + n, mask=nok, other=0.0).to(tl.float32)[None, :]
        tl.store(Part + at, acc.to(X.dtype.element_ty), mask=ok)
    else:
        tl.store(Part + ps * n_rows * n_out + at, acc, mask=ok)


@triton.jit
def gemv_sum(Part, Bias, Out, n_out, splits, n_bias, BLOCK: tl.constexpr, S: tl.constexpr,
             BIAS: tl.constexpr, PDL: tl.constexpr = 0):  # fmt: skip
    allow_next(PDL)
    wait_previous(PDL)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat [rows x N] outputs
    rok = rows < n_out
    s = tl.arange(0, S)
    y = tl.sum(
        tl.load(
            Part + s[:, None] * n_out + rows[None, :],
            mask=(s < splits)[:, None] & rok[None, :],
            other=0.0,
        ),
        0,
    )
    if BIAS:
        y += tl.load(Bias + rows % n_bias, mask=rok, other=0.0).to(tl.float32)
    tl.store(Out + rows, y.to(Out.dtype.element_ty), mask=rok)
