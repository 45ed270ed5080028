"""The Triton kernels of fp8.py (imported on first use, so that importing fp8.py needs no triton): projections
whose weight is float8_e4m3fn [N, K] with fp32 scales per 128 x 128 block [ceil(N/128), ceil(K/128)].

Every weight tile lies inside one scale block (BN and BK divide 128, tiles start at their multiples): its
scale is one number, loaded beside it, that multiplies the tile's product with the input rather than each
weight. The input rows go through `gemv_input` (gemv_kernels.py): plain, HF's act(gate) * up, or a gate/up
GEMV's fp32 partial sums.
"""

import torch
import triton
import triton.language as tl

from dflash_zoo.cuda.ops.gemv_kernels import activation, gemv_input

QMAX = tl.constexpr(448.0)  # e4m3's largest finite value
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def fp8_gemv_part(W, S, X, Gate, Part, n_out, k_in, k_split, s_stride, in_splits, in_plane, DT: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr, PREFETCH: tl.constexpr,
                  IN_PARTS: tl.constexpr):  # fmt: skip
    """Rows [BN] of dequant(W) x over one K slice -> their fp32 partial sums: each e4m3 weight times x times
    the tile's scale, in fp32. DT: the activations' dtype (the rounding of a gated input). PREFETCH: the next
    tile's load is issued before the current one is multiplied."""
    pn, ps = tl.program_id(0), tl.program_id(1)  # output rows, K slice
    rows = pn * BN + tl.arange(0, BN)
    rok = rows < n_out
    w_rows = W + rows[:, None] * k_in
    s_row = S + (pn * BN // 128) * s_stride  # the tile's block row
    k_lo, k_hi = ps * k_split, ps * k_split + k_split
    acc = tl.zeros([BN, BK], tl.float32)
    if PREFETCH:
        cols = k_lo + tl.arange(0, BK)
        w = tl.load(w_rows + cols[None, :], mask=rok[:, None] & (cols < k_in)[None, :], other=0.0)
        for k0 in range(k_lo, k_hi, BK):
            cols = k0 + tl.arange(0, BK)
            nxt = cols + BK
            w_next = tl.load(w_rows + nxt[None, :], mask=rok[:, None] & ((nxt < k_in) & (nxt < k_hi))[None, :],
                             other=0.0)  # fmt: skip
            s = tl.load(s_row + tl.minimum(k0, k_in - 1) // 128)
            x = gemv_input(X, Gate, cols, cols < k_in, in_splits, in_plane, DT, ACT, IN_PARTS)
            acc += w.to(tl.float32) * (x * s)[None, :]
            w = w_next
    else:
        for k0 in range(k_lo, k_hi, BK):
            cols = k0 + tl.arange(0, BK)
            cok = cols < k_in
            w = tl.load(w_rows + cols[None, :], mask=rok[:, None] & cok[None, :], other=0.0)
            s = tl.load(s_row + tl.minimum(k0, k_in - 1) // 128)
            x = gemv_input(X, Gate, cols, cok, in_splits, in_plane, DT, ACT, IN_PARTS)
            acc += w.to(tl.float32) * (x * s)[None, :]
    tl.store(Part + ps * n_out + rows, tl.sum(acc, 1), mask=rok)


@triton.jit
def fp8_gemm(W, S, X, Gate, Out, Bias, n_rows, n_out, k_in, k_split, x_stride, g_stride, s_stride,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr, DIRECT: tl.constexpr,
             BIAS: tl.constexpr, IEEE: tl.constexpr, W8A8: tl.constexpr):  # fmt: skip
    """Rows [BM] x columns [BN] of x [rows, K] @ dequant(W)^T over one slice of K, on the tensor cores. Each
    tile's product is scaled by its block's scales as it is added: x (16-bit) times the e4m3 weight exactly
    in the activations' type, or with W8A8 (BK 128) x quantized per row and 128-column group to e4m3 (amax /
    448) and multiplied on the FP8 tensor cores. DIRECT (one slice): the output, plus bias, in x's dtype;
    else fp32 partial sums [slices, rows, N]."""
    pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # rows, output columns, K slice
    r = pm * BM + tl.arange(0, BM)
    n = pn * BN + tl.arange(0, BN)
    rok, nok = r < n_rows, n < n_out
    s_col = S + (pn * BN // 128) * s_stride  # the tile's block row
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(ps * k_split, ps * k_split + k_split, BK):
        cols = k0 + tl.arange(0, BK)
        cok = cols < k_in
        xm = rok[:, None] & cok[None, :]
        x = tl.load(X + r[:, None] * x_stride + cols[None, :], mask=xm, other=0.0)  # [BM, BK]
        if ACT:  # as gemv_input: act(gate) * up, each op rounded to the dtype
            g = tl.load(Gate + r[:, None] * g_stride + cols[None, :], mask=xm, other=0.0).to(tl.float32)
            x = (activation(g, ACT).to(x.dtype).to(tl.float32) * x.to(tl.float32)).to(x.dtype)
        w = tl.load(W + n[:, None] * k_in + cols[None, :], mask=nok[:, None] & cok[None, :], other=0.0)
        s = tl.load(s_col + tl.minimum(k0, k_in - 1) // 128)
        if W8A8:  # one scale per row of the 128-column group; an all-zero group's is tiny, its values 0
            xf = x.to(tl.float32)
            # IEEE divisions (`/` is approximate on CUDA): the scales and values torch's reference computes
            xs = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), 1), 1e-30), QMAX)  # [BM]
            xq = tl.clamp(tl.div_rn(xf, xs[:, None]), -QMAX, QMAX).to(tl.float8e4nv)
            acc += tl.dot(xq, tl.trans(w)) * (xs * s)[:, None]
        elif IEEE:  # fp32 activations: exact products, not TF32
            acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee") * s
        else:  # e4m3 values are exact in fp16 and bf16
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s
    at = r[:, None] * n_out + n[None, :]
    ok = rok[:, None] & nok[None, :]
    if DIRECT:
        if BIAS:
            acc += tl.load(Bias + n, mask=nok, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + at, acc.to(X.dtype.element_ty), mask=ok)
    else:
        tl.store(Out + ps * n_rows * n_out + at, acc, mask=ok)
