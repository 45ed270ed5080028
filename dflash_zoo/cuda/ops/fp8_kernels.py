"""The Triton kernels of fp8.py (imported on first use, so that importing fp8.py needs no triton): projections
whose weight is float8_e4m3fn [N, K] with fp32 scales per 128 x 128 block [ceil(N/128), ceil(K/128)].

The tensor-core kernel's weight tile lies inside one scale block (BN divides 128, BK is 128): its scale is one
number, loaded beside it, that multiplies the tile's product with the input rather than each weight; its rows
come gated already (fp8.py). The GEMV (gemv_kernels.py) scales the input instead, each column by its block's
scale (so its BK may span blocks), its one row through `gemv_input`: plain, HF's act(gate) * up, or a gate/up
GEMV's fp32 partial sums.

e4m3 -> bf16 (`e4m3_bf16`, on CUDA): Triton's cast goes through fp16 with conversion instructions, which
Hopper issues at a quarter of the integer rate; in the tensor-core kernel they, not the memory, bound a
verify step. Bit operations place the e4m3 exponent and mantissa into a bf16 (exponent bias 127 against
e4m3's 7, so the value is 2^-120 times the weight, subnormals included) and one bf16 multiply by 2^120 makes
it exact.
"""

import triton
import triton.language as tl

QMAX = tl.constexpr(448.0)  # e4m3's largest finite value
# 4 e4m3 bytes [b3 b2 b1 b0] -> two bf16 pairs ($0: b1 b0, $1: b3 b2): each byte into the high half of a 16-bit
# lane (prmt), its exponent and mantissa bits masked and shifted down 4 into a bf16's, its sign kept in place
# (lop3 0xF8: a | (lane & 0x8000 per lane)), then times 2^120 (bf16 0x7B80) per lane
E4M3_BF16_PTX = tl.constexpr("""{
.reg .b32 lo, hi, a, b, two120;
mov.b32 two120, 0x7B807B80;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
and.b32 a, lo, 0x7F007F00;
and.b32 b, hi, 0x7F007F00;
shr.b32 a, a, 4;
shr.b32 b, b, 4;
lop3.b32 $0, a, lo, 0x80008000, 0xF8;
lop3.b32 $1, b, hi, 0x80008000, 0xF8;
mul.rn.bf16x2 $0, $0, two120;
mul.rn.bf16x2 $1, $1, two120;
}""")


@triton.jit
def e4m3_bf16(w):
    """float8e4nv tile -> the same values in bf16, exactly, with integer and bf16x2 instructions (CUDA only)."""
    return tl.inline_asm_elementwise(
        E4M3_BF16_PTX, "=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4
    )


@triton.jit
def fp8_gemm(W, S, X, Out, Bias, n_rows, n_out, k_in, k_split, x_stride, s_stride, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, DIRECT: tl.constexpr, BIAS: tl.constexpr, IEEE: tl.constexpr,
             W8A8: tl.constexpr, BITS: tl.constexpr, SWAP: tl.constexpr = False):  # fmt: skip
    """Rows [BM] x columns [BN] of x [rows, K] @ dequant(W)^T over one slice of K, on the tensor cores. Each
    tile's product is scaled by its block's scales as it is added: x (16-bit) times the e4m3 weight exactly
    in the activations' type, or with W8A8 (BK 128) x quantized per row and 128-column group to e4m3 (amax /
    448) and multiplied on the FP8 tensor cores; SWAP (with W8A8): the weight tile on the left, so that
    wgmma's 64+ rows are BN weight rows and x's BM rows need no padding. DIRECT (one slice): the output, plus
    bias, in x's dtype; else fp32 partial sums [slices, rows, N]. BITS: bf16 x, the weight converted by
    `e4m3_bf16` (CUDA)."""
    pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # rows, output columns, K slice
    r = pm * BM + tl.arange(0, BM)
    n = pn * BN + tl.arange(0, BN)
    rok, nok = r < n_rows, n < n_out
    s_col = S + (pn * BN // 128) * s_stride  # the tile's block row
    if SWAP:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(ps * k_split, ps * k_split + k_split, BK):
        cols = k0 + tl.arange(0, BK)
        cok = cols < k_in
        xm = rok[:, None] & cok[None, :]
        x = tl.load(X + r[:, None] * x_stride + cols[None, :], mask=xm, other=0.0)  # [BM, BK]
        w = tl.load(W + n[:, None] * k_in + cols[None, :], mask=nok[:, None] & cok[None, :], other=0.0)
        s = tl.load(s_col + tl.minimum(k0, k_in - 1) // 128)
        if W8A8:  # one scale per row of the 128-column group; an all-zero group's is tiny, its values 0
            xf = x.to(tl.float32)
            # IEEE divisions (`/` is approximate on CUDA): the scales and values torch's reference computes
            xs = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), 1), 1e-30), QMAX)  # [BM]
            xq = tl.clamp(tl.div_rn(xf, xs[:, None]), -QMAX, QMAX).to(tl.float8e4nv)
            if SWAP:  # [BN, BK] x [BK, BM]
                acc += tl.dot(w, tl.trans(xq)) * (xs * s)[None, :]
            else:
                acc += tl.dot(xq, tl.trans(w)) * (xs * s)[:, None]
        elif BITS:
            acc += tl.dot(x, tl.trans(e4m3_bf16(w))) * s
        elif IEEE:  # fp32 activations: exact products, not TF32
            acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee") * s
        else:  # e4m3 values are exact in fp16 and bf16
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * s
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    at = r[:, None] * n_out + n[None, :]
    ok = rok[:, None] & nok[None, :]
    if DIRECT:
        if BIAS:
            acc += tl.load(Bias + n, mask=nok, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + at, acc.to(X.dtype.element_ty), mask=ok)
    else:
        tl.store(Out + ps * n_rows * n_out + at, acc, mask=ok)
