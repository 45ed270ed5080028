"""Routed experts of a sparse MoE block for a few rows: one Triton GEMV per projection over the chosen experts.

Why: transformers' `grouped_mm` experts path sorts the (token, expert) pairs, counts tokens per expert,
gathers, runs two grouped GEMMs sized for many rows and scatters back: ~25 kernels a layer, and at one row the
MoE block of a Qwen3-Coder-30B-A3B shape took most of a 7.9 ms step for 6.1 GB of weights
(docs/performance.md). Here each (token, expert) pair is one GEMV row block that reads only its expert's
weights: `expert_linear` for the gate/up and the down projection, the experts module's own `_apply_gate`
between them (each family's activation, clamps and gate/up interleaving stay its own), then the routing
weights and the sum over a token's experts as transformers computes them.

The weight layouts are the ones transformers' experts decorator declares on the module (`integrations/moe.py`:
`is_transposed`, `has_bias`, `has_gate`); a module without them, or with a post-expert norm, keeps its own
forward (`supported`). The GEMV is a torch custom op, so CUDA graphs capture its launch and `torch.compile`
sees one call; under Triton's interpreter it runs on CPU (tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

# (output rows per program, K per iteration, warps)
CONFIG = (32, 128, 4)


def supported(experts: nn.Module) -> str | None:
    """None when `routed` can run this experts module, else why not."""
    flags = ("is_transposed", "has_bias", "has_gate")
    if not all(hasattr(experts, f) for f in flags) or not hasattr(experts, "gate_up_proj"):
        return f"{type(experts).__name__} declares no transformers experts layout"
    if getattr(experts, "has_post_expert_norm", False):
        return f"{type(experts).__name__} has a post-expert norm"
    if not experts.has_gate:
        return f"{type(experts).__name__} has no gate projection"
    return None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def expert_gemv(X, W, Bias, Idx, Out, n_out, k_in, per_row, s_e, s_n, s_k,
                    BN: tl.constexpr, BK: tl.constexpr, BIAS: tl.constexpr):  # fmt: skip
        s, pn = tl.program_id(0), tl.program_id(1)  # (token, expert) pair, output rows
        e = tl.load(Idx + s).to(tl.int64)
        x_row = s // per_row  # the pair's token
        rows = pn * BN + tl.arange(0, BN)
        rok = rows < n_out
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(0, k_in, BK):
            cols = k0 + tl.arange(0, BK)
            cok = cols < k_in
            x = tl.load(X + x_row * k_in + cols, mask=cok, other=0.0).to(tl.float32)
            w = tl.load(
                W + e * s_e + rows[:, None] * s_n + cols[None, :] * s_k,
                mask=rok[:, None] & cok[None, :],
                other=0.0,
            )
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, 1).to(Out.dtype.element_ty)  # rounded as a GEMM's output, then the bias added
        if BIAS:
            b = tl.load(Bias + e * n_out + rows, mask=rok, other=0.0)
            y = (y.to(tl.float32) + b.to(tl.float32)).to(Out.dtype.element_ty)
        tl.store(Out + s * n_out + rows, y, mask=rok)

    return expert_gemv


@torch.library.custom_op("dflash_zoo::expert_linear", mutates_args=())
def expert_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, experts: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """x [R, K]; weight [E, N, K] ([E, K, N] when `transposed`); bias [E, N]; experts [S] (S a multiple of R:
    pair s belongs to row s // (S / R)) -> [S, N]: pair s's row through its expert's projection."""
    rows, k = x.shape
    n = weight.shape[2] if transposed else weight.shape[1]
    s_e = weight.stride(0)
    s_n, s_k = (weight.stride(2), weight.stride(1)) if transposed else (weight.stride(1), weight.stride(2))
    pairs = experts.numel()
    out = torch.empty(pairs, n, device=x.device, dtype=x.dtype)
    bn, bk, warps = CONFIG
    b = bias if bias is not None else out
    _kernel()[(pairs, -(-n // bn))](
        x.contiguous(), weight, b, experts.contiguous(), out, n, k, pairs // rows, s_e, s_n, s_k,
        BN=bn, BK=bk, BIAS=bias is not None, num_warps=warps,
    )  # fmt: skip
    return out


@expert_linear.register_fake
def _(x, weight, bias, experts, transposed):
    return x.new_empty(experts.numel(), weight.shape[2] if transposed else weight.shape[1])


def routed(experts: Any, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """What `experts(x, index, weights)` returns, through `expert_linear`: x [N, H], index / weights [N, k]."""
    n, k = index.shape
    pairs = index.reshape(-1)  # [N * k]: token t's experts at t * k ...
    up_bias = experts.gate_up_proj_bias if experts.has_bias else None
    h = expert_linear(x, experts.gate_up_proj, up_bias, pairs, experts.is_transposed)  # [N * k, 2I]
    h = experts._apply_gate(h)  # [N * k, I]: the family's activation over its gate / up layout
    down_bias = experts.down_proj_bias if experts.has_bias else None
    y = expert_linear(h, experts.down_proj, down_bias, pairs, experts.is_transposed)  # [N * k, H]
    # as transformers: each expert's output times its routing weight, summed over the token's experts
    return (y * weights.reshape(-1, 1)).view(n, k, -1).sum(dim=1).to(x.dtype)
