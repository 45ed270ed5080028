"""One kernel for each residual add of a sandwich-norm decoder layer (Gemma 4), where a sublayer's output is
normed before it joins the residual, and for the norms that then read the new residual.

Why: on the Gemma 4 26B-A4B shape a one-row step ran ~68 kernels a layer, most of them one-row norms, adds and
sums of a few KB each (docs/performance.md). Around the attention sublayer this kernel replaces the o GEMV's
sum, the output norm, the residual add and the MLP's input norms (the dense MLP's, the experts', the router's);
around the MLP the sums of the dense and routed outputs, their two norms, their sum, the outer norm, the
residual add, the layer scalar and the next layer's input norm: x -> (x + norm_o(norm_1(d1) + norm_2(d2))) * s,
then norm_j(x) for up to three weights. Each op is rounded to the dtype where transformers rounds it (each
norm's output, the sum of the two branches, the residual add, the scalar product), all norms in the declared
fp32-weight formula; the last output may instead take Llama's (the norm rounded, times the weight, rounded)
and a constant after it (Gemma 4's router input: a weightless norm times its scale times H^-1/2).

A torch custom op (captured by CUDA graphs, opaque to torch.compile), on CUDA or under Triton's interpreter;
its kernel is in sandwich_kernels.py. Which layers run it, and with which inputs: cuda/static/sandwich.py.
"""

from __future__ import annotations

import functools

import torch

from dflash_zoo.cuda.ops.fused import check_sums
from dflash_zoo.cuda.ops.runtime import pow2


@functools.cache
def _kernels():
    from dflash_zoo.cuda.ops import sandwich_kernels  # triton on first use only

    return sandwich_kernels.sandwich_add


def _delta(d: torch.Tensor | None, like: torch.Tensor, parts: bool) -> tuple[torch.Tensor, int]:
    """(a sublayer output laid out for the kernel, its slice count): [rows, n] like x, or fp32 sums [s, rows, n]."""
    if d is None:
        return like, 0
    if parts:
        check_sums(d, like)
        return d.contiguous(), d.shape[0]
    if d.shape != like.shape:
        raise ValueError(
            f"a sublayer output {list(d.shape)} is not shaped like the residual {list(like.shape)}"
        )
    return d.contiguous(), 1


@torch.library.custom_op("dflash_zoo::sandwich_add", mutates_args=())
def sandwich_add(
    x: torch.Tensor,
    d1: torch.Tensor,
    w1: torch.Tensor,
    norms: list[torch.Tensor],
    eps: float,
    fp32_weight: bool = True,
    offset: float = 0.0,
    parts1: bool = False,
    d2: torch.Tensor | None = None,
    w2: torch.Tensor | None = None,
    parts2: bool = False,
    outer: torch.Tensor | None = None,
    scalar: torch.Tensor | None = None,
    last_llama: bool = False,
    post: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (the residual) -> (x + outer_norm(norm_w1(d1) + norm_w2(d2))) * scalar, and its RMSNorm with
    each weight of `norms` (at most three) stacked [len(norms), ..., n]. d1, d2: sublayer outputs like x, or with
    `parts1` / `parts2` fp32 partial sums [splits, rows, n] (`gemv.gemv_parts`, the expert kernels' weighted
    slices) summed in order; d2 (with w2), `outer` and `scalar` ([1]) are optional. `last_llama`: the last of
    `norms` in Llama's formula, then times `post`."""
    if not 0 <= len(norms) <= 3 or (last_llama and not norms):
        raise ValueError(f"{len(norms)} output norms: up to three (one at least with last_llama)")
    if (d2 is None) != (w2 is None):
        raise ValueError("a second branch takes its norm weight")
    x = x.contiguous()
    n, rows = x.shape[-1], x.numel() // x.shape[-1]
    (a, s1), (b, s2) = _delta(d1, x, parts1), _delta(d2, x, parts2)
    total = torch.empty_like(x)
    y = x.new_empty(len(norms), *x.shape)
    ws = [w.contiguous() for w in norms] + [w1] * (3 - len(norms))
    d = pow2(n)
    _kernels()[(rows,)](
        x, a, w1.contiguous(), b, w2 if w2 is not None else w1, outer if outer is not None else w1,
        scalar if scalar is not None else x, *ws, total, y, rows, n, s1, s2, eps, offset, post, D=d,
        FP32_WEIGHT=fp32_weight, PARTS1=parts1, PARTS2=parts2, TWO=d2 is not None, OUTER=outer is not None,
        SCALAR=scalar is not None, NORMS=len(norms), LAST_LLAMA=last_llama,
        num_warps=4 if d <= 1024 else 8 if d <= 2048 else 16,
    )  # fmt: skip
    return total, y


@sandwich_add.register_fake
def _(x, d1, w1, norms, eps, fp32_weight=True, offset=0.0, parts1=False, d2=None, w2=None, parts2=False,
      outer=None, scalar=None, last_llama=False, post=1.0):  # fmt: skip
    return torch.empty_like(x), x.new_empty(len(norms), *x.shape)
