"""DFlash 2's own work as one kernel each: a convolution along the block, and the candidate selector's walk.

Why: the torch forms (dflash_zoo/drafters/dflash2.py, the reference these are tested against) run ~2K + 2
kernels per convolution (four per drafter layer) and ~6 per slot of the selector's sequential walk; inside a CUDA
graph each kernel costs a few microseconds, so on a small target the drafter's share of a step would grow by
hundreds of them.
- `block_conv(x, coeff, base, residual)`: y[t] = residual[t] + sum_j (base[j] + coeff[t, j]) * x[t - j] over one
  block of N rows (taps before row 0 read zeros), coefficients shared by groups of g channels;
- `selector_walk(...)`: the whole left-to-right walk over the block's slots in one program (k candidates and a
  rank-r code per slot fit one tile), greedy or by an exponential race on q = softmax(scores / T).
Torch custom ops (captured by CUDA graphs), on CUDA or under Triton's interpreter (the CPU tests).
"""

from __future__ import annotations

import functools

import torch

from dflash_zoo.cuda.ops.runtime import pow2


@functools.cache
def _kernels():
    from dflash_zoo.cuda.ops import dflash2_kernels  # triton on first use only

    return dflash2_kernels


@torch.library.custom_op("dflash_zoo::block_conv", mutates_args=())
def block_conv(
    x: torch.Tensor, coeff: torch.Tensor, base: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [N, H] one block's rows, coeff [N, K, G] (a view with unit last stride), base [K, H] -> [N, H]."""
    n, h = x.shape
    k, groups = coeff.shape[1], coeff.shape[2]
    if coeff.stride(-1) != 1 or base.shape != (k, h) or h % groups:
        raise ValueError(f"block_conv: x {list(x.shape)}, coeff {list(coeff.shape)}, base {list(base.shape)}")
    x, base = x.contiguous(), base.contiguous()
    res = x if residual is None else residual.contiguous()
    y = torch.empty_like(x)
    block = min(1024, pow2(h))
    grid = (n, -(-h // block))
    _kernels().block_conv[grid](
        x, coeff, coeff.stride(0), coeff.stride(1), base, res, y, h, h // groups, K=k,
        RESIDUAL=residual is not None, BLOCK=block,
    )  # fmt: skip
    return y


@block_conv.register_fake
def _(x, coeff, base, residual=None):
    return torch.empty_like(x)


@torch.library.custom_op("dflash_zoo::selector_walk", mutates_args=())
def selector_walk(
    unary: torch.Tensor,
    cands: torch.Tensor,
    proj: torch.Tensor,
    pred: torch.Tensor,
    succ: torch.Tensor,
    anchor: torch.Tensor,
    race: torch.Tensor | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """unary [n, k] candidate logits, cands [n, k] ids, proj [n, r] projected slot states, pred / succ [V, r]
    codebooks, anchor [1] -> (drafts [n], q [n, k] (zeros when greedy)). `race` [n, k] ~ Exp(1) when sampling."""
    n, k = cands.shape
    r = proj.shape[1]
    out = torch.empty(n, dtype=torch.long, device=cands.device)
    q = torch.zeros(n, k, dtype=torch.float32, device=cands.device)
    sample = temperature > 0
    _kernels().selector_walk[(1,)](
        unary.float().contiguous(), cands.contiguous(), proj.contiguous(), pred, succ, anchor,
        race if sample else q, out, q, n, k, r, 1.0 / temperature if sample else 1.0,
        KB=pow2(k, 16), RB=pow2(r, 16), SAMPLE=sample,
    )  # fmt: skip
    return out, q


@selector_walk.register_fake
def _(unary, cands, proj, pred, succ, anchor, race, temperature):
    n, k = cands.shape
    return cands.new_empty(n), unary.new_empty(n, k, dtype=torch.float32)
