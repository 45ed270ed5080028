"""The Triton kernels of dflash2.py (imported on first use, so that importing dflash2.py needs no triton)."""

import triton
import triton.language as tl


@triton.jit
def block_conv(
    X, C, c_row, c_tap, B, R, Y, h, g, K: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
):
    """Y[t, ch] = (R[t, ch] +) sum_j (B[j, ch] + C[t, j, ch // g]) * X[t - j, ch], t - j >= 0 (one block)."""
    t, col = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < h
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        if t >= j:  # taps before the block's first slot read zeros
            x = tl.load(X + (t - j) * h + col, mask=ok, other=0.0).to(tl.float32)
            base = tl.load(B + j * h + col, mask=ok, other=0.0).to(tl.float32)
            coef = tl.load(C + t * c_row + j * c_tap + col // g, mask=ok, other=0.0).to(tl.float32)
            acc += (base + coef) * x
    if RESIDUAL:
        acc += tl.load(R + t * h + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + t * h + col, acc.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def selector_walk(U, Cand, Proj, Pred, Succ, Anchor, Race, Out, Q, n, k, r, inv_t,
                  KB: tl.constexpr, RB: tl.constexpr, SAMPLE: tl.constexpr):  # fmt: skip
    """The candidate selector's left-to-right walk over n slots, in one program.

    Slot t: s = U[t] + Succ[Cand[t]] @ (Pred[prev] * Proj[t]); greedy takes argmax s, sampling the argmax of
    softmax(s / T) / Race[t] (an exponential race: Race ~ Exp(1) picks i with probability q_i), writing q.
    """
    kk, rr = tl.arange(0, KB), tl.arange(0, RB)
    kok, rok = kk < k, rr < r
    prev = tl.load(Anchor)
    for t in range(n):
        code = tl.load(Pred + prev * r + rr, mask=rok, other=0.0).to(tl.float32)
        code = code * tl.load(Proj + t * r + rr, mask=rok, other=0.0).to(tl.float32)  # [RB]
        cand = tl.load(Cand + t * k + kk, mask=kok, other=0)  # [KB]
        succ = tl.load(Succ + cand[:, None] * r + rr[None, :], mask=kok[:, None] & rok[None, :], other=0.0)
        s = tl.load(U + t * k + kk, mask=kok, other=0.0).to(tl.float32) + tl.sum(
            succ.to(tl.float32) * code[None, :], 1
        )
        s = tl.where(kok, s, float("-inf"))
        if SAMPLE:
            e = tl.exp((s - tl.max(s, 0)) * inv_t)
            q = e / tl.sum(e, 0)
            tl.store(Q + t * k + kk, q, mask=kok)
            race = tl.load(Race + t * k + kk, mask=kok, other=1.0)
            pick = tl.argmax(tl.where(kok, q / race, -1.0), 0)
        else:
            pick = tl.argmax(s, 0)
        prev = tl.load(Cand + t * k + pick)
        tl.store(Out + t, prev)
