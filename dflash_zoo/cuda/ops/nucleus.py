"""Top-p (nucleus) filtering without a sort: the probability threshold found by a search over its float bits.

The rule (`engine/sampling.nucleus`): keep token i when the mass of the tokens strictly more probable than i is
below top_p. The mass strictly above a value only falls as the value grows, so that keeps exactly the tokens
with p_i > a, where a is the largest value whose mass strictly above is still >= top_p; tied tokens are kept or
dropped together.

Why not sort: at 15-16 rows of a 151,936-token vocabulary (a DFlash step's draft and verify slots), a sort, a
cumulative sum and a softmax run one thread block per row on a 132-SM H200: ~0.45 ms per call, two calls a step
(docs/performance.md). Here the non-negative fp32 bits of p order like integers, so a's bits are searched 4 at
a time: each of 8 passes tests 15 candidate values at once, every (row, chunk of the vocabulary) program
summing the mass above each candidate over its chunk; the next pass adds the chunks' sums in a fixed order
(deterministic, no atomics) and narrows the interval to one sixteenth. A last launch writes p where p > a.
~10 launches over many programs per row instead of a few one-block-per-row kernels.

Torch custom op, on CUDA or under Triton's interpreter (`TRITON_INTERPRET=1`, CPU tests); its kernel is in
nucleus_kernels.py.
"""

from __future__ import annotations

import functools

import torch

DIGIT = 4  # threshold bits decided per pass
PASSES = 32 // DIGIT
CANDIDATES = 1 << DIGIT  # slot 0 is the interval's low end itself (never tested)
BLOCK = 1024  # vocabulary entries per inner iteration


@functools.cache
def _kernel():
    from dflash_zoo.cuda.ops import nucleus_kernels  # triton on first use only

    return nucleus_kernels.nucleus_pass


def _chunks(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(entries per chunk, chunks per row): about two programs per SM, whole blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, min(64, -(-2 * sms // rows)))
    chunk = BLOCK * -(-vocab // (want * BLOCK))
    return chunk, -(-vocab // chunk)


@torch.library.custom_op("dflash_zoo::nucleus_mask", mutates_args=())
def nucleus_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [R, V] fp32 (rows sum to 1) -> probs inside each row's nucleus, 0 outside (not renormalised)."""
    if probs.dtype != torch.float32 or probs.dim() != 2:
        raise ValueError(
            f"nucleus_mask takes [rows, vocab] fp32 probabilities, not {probs.dtype} {list(probs.shape)}"
        )
    probs = probs.contiguous()
    rows, vocab = probs.shape
    chunk, n_chunks = _chunks(rows, vocab, probs.device)
    lo = torch.zeros(PASSES, rows, dtype=torch.int64, device=probs.device)
    sums = torch.empty(PASSES, rows, n_chunks, CANDIDATES, dtype=torch.float32, device=probs.device)
    out = torch.empty_like(probs)
    run = _kernel()
    meta = dict(C=max(2, 1 << (n_chunks - 1).bit_length()), K=CANDIDATES, N=BLOCK, DIGIT=DIGIT)
    for k in range(PASSES + 1):  # the last launch writes the output
        run[(rows, n_chunks)](
            probs, out, lo, sums, top_p, vocab, chunk, n_chunks, k, KEEP=k == PASSES, **meta
        )
    return out


@nucleus_mask.register_fake
def _(probs, top_p):
    return torch.empty_like(probs)
