"""The Triton kernel of nucleus.py (imported on first use, so that importing nucleus.py needs no triton): one
pass of the threshold search over (row, vocabulary chunk) programs, or with KEEP the masked output."""

import triton
import triton.language as tl


@triton.jit
def nucleus_pass(P, Out, Lo, Sums, top_p, vocab, chunk, n_chunks, k, C: tl.constexpr, K: tl.constexpr,
                 N: tl.constexpr, KEEP: tl.constexpr, DIGIT: tl.constexpr):  # fmt: skip
    """Pass k < PASSES: the candidates' masses over one (row, chunk); KEEP (k == PASSES): the output."""
    r, ch = tl.program_id(0), tl.program_id(1)  # row, vocabulary chunk
    rows = tl.num_programs(0)
    d = tl.arange(0, K)
    # the interval's low end, always a value whose mass strictly above is >= top_p (0 is: all mass is above
    # it): pass 0 starts at 0; later passes move it past the previous pass's too-low candidates
    lo = tl.load(Lo + r)
    if k > 0:
        lo = tl.load(Lo + (k - 1) * rows + r)
        c = tl.arange(0, C)
        at = (((k - 1) * rows + r) * n_chunks + c[:, None]) * K + d[None, :]
        above = tl.sum(tl.load(Sums + at, mask=(c < n_chunks)[:, None], other=0.0), 0)  # [K], chunks in order
        # candidates whose mass above is still >= top_p are too low; they form a prefix of slots 1..K-1
        too_low = tl.sum(((above >= top_p) & (d > 0)).to(tl.int64), 0)
        lo = lo + too_low * (1 << (32 - DIGIT * k))
        if ch == 0 and not KEEP:
            tl.store(Lo + k * rows + r, lo)
    cand = lo + d.to(tl.int64) * (1 << (32 - DIGIT - DIGIT * k))  # [K] candidate values, as int bits
    acc = tl.zeros([K], tl.float32)
    for start in range(ch * chunk, ch * chunk + chunk, N):
        j = start + tl.arange(0, N)
        p = tl.load(P + r * vocab + j, mask=j < vocab, other=0.0)
        bits = p.to(tl.int32, bitcast=True).to(tl.int64)
        if KEEP:  # lo is now the largest value still too low: keep what lies above it
            tl.store(Out + r * vocab + j, tl.where(bits > lo, p, 0.0), mask=j < vocab)
        else:
            acc += tl.sum(tl.where(bits[:, None] > cand[None, :], p[:, None], 0.0), 0)
    if not KEEP:
        tl.store(Sums + ((k * rows + r) * n_chunks + ch) * K + d, acc)
