"""Triton kernels of a Gated-DeltaNet (linear-attention) layer's work around its projections, as torch custom ops
(captured by CUDA graphs, opaque to `torch.compile`; on CUDA or under Triton's interpreter):
- `gdn_conv_gates`: the causal depthwise conv with SiLU, split into q | k | v, the log decay g and the gate beta;
  the conv window moves on inside it (or stays, for a verify);
- `window_commit`: after a verify, the window moves past the first n rows (n read on device);
- `delta_rule`: the gated delta rule over a few rows, the state updated in place or kept, value heads reading
  their key heads (no repeated heads, no state copy); with a count read on device it is a verify's commit.
The kernels are in gdn_kernels.py (the rule's definition there); the layer that runs them:
cuda/static/gdn.py.
"""

from __future__ import annotations

import torch

from dflash_zoo.cuda.ops.runtime import pow2


def _kernels():
    from dflash_zoo.cuda.ops import gdn_kernels  # needs triton: imported on first use

    return gdn_kernels


ROW_BLOCK, CHANNEL_BLOCK = 16, 128  # conv rows and channels per program
VALUE_BLOCK = 8  # value columns per delta-rule program (one warp each): Hv x Dv / 8 programs, ~4 per SM at 9B


def _rows(y: torch.Tensor) -> torch.Tensor:
    """[1, T, W] with unit column stride (rows may be strided: column slices of one projection's output)."""
    return y if y.stride(-1) == 1 else y.contiguous()


@torch.library.custom_op("dflash_zoo::gdn_conv_gates", mutates_args=("window",))
def gdn_conv_gates(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, b: torch.Tensor,
    a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, key_dim: int, zero: bool, store: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [1, T, C] (conv input), window [1, C, K-1], weight [C, 1, K], b and a [1, T, Hv] -> (silu(conv) as
    q | k | v, flat [T C]; g [T, Hv] fp32; beta [T, Hv]). `zero`: the window is taken as empty; `store`: it
    takes the last K-1 conv inputs."""
    x, b, a = _rows(x), _rows(b), _rows(a)
    t, c = x.shape[-2:]
    hv, ks = b.shape[-1], weight.shape[-1]
    out = x.new_empty(t * c)
    g, beta = torch.empty(t, hv, device=x.device, dtype=torch.float32), b.new_empty(t, hv)
    grid = (-(-c // CHANNEL_BLOCK), -(-t // ROW_BLOCK))
    _kernels().conv_gates[grid](
        x, x.stride(-2), window, weight, bias if bias is not None else weight, out, b, b.stride(-2), a, a.stride(-2),
        a_log, dt_bias, g, beta, t, c, key_dim, hv, KS=ks, R=ROW_BLOCK, BC=CHANNEL_BLOCK, WS=pow2(ks - 1, 2),
        HP=pow2(hv, 2), BIAS=bias is not None, ZERO=zero, STORE=store,
    )  # fmt: skip
    return out, g, beta


@gdn_conv_gates.register_fake
def _(x, window, weight, bias, b, a, a_log, dt_bias, key_dim, zero, store):
    t, c, hv = x.shape[-2], x.shape[-1], b.shape[-1]
    return x.new_empty(t * c), x.new_empty(t, hv, dtype=torch.float32), b.new_empty(t, hv)


@torch.library.custom_op("dflash_zoo::gdn_window_commit", mutates_args=("window",))
def window_commit(x: torch.Tensor, window: torch.Tensor, n: torch.Tensor) -> None:
    """After a verify of conv input rows x [1, T, C]: the window [1, C, K-1] moves past the first n (0-d
    long tensor on x's device)."""
    x = _rows(x)
    c, ks = x.shape[-1], window.shape[-1] + 1
    grid = (-(-c // CHANNEL_BLOCK),)
    _kernels().window_commit[grid](x, x.stride(-2), window, n, c, KS=ks, BC=CHANNEL_BLOCK, WS=pow2(ks - 1, 2))


@window_commit.register_fake
def _(x, window, n):
    return None


@torch.library.custom_op("dflash_zoo::gdn_delta_rule", mutates_args=("state",))
def delta_rule(
    q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, n: torch.Tensor | None, store: bool = True,
) -> torch.Tensor:  # fmt: skip
    """The gated delta rule over rows [0, n) (all T rows when n is None) of q, k [1, T, Hk, Dk] (contiguous),
    v [1, T, Hv, Dv], g (fp32) and beta [1, T, Hv], from `state` [1, Hv, Dk, Dv] (fp32), and with `store` back
    into it. Returns o [1, T, Hv, Dv], or an empty tensor when q is None (a commit: only the state is wanted)."""
    q = q.contiguous() if q is not None else None
    k, v, g, beta = (y.contiguous() for y in (k, v, g, beta))  # the kernel reads whole rows at row strides
    _, t, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    out = v.new_empty(v.shape) if q is not None else v.new_empty(0)
    grid = (-(-dv // VALUE_BLOCK), hv)
    _kernels().delta_rule[grid](
        q if q is not None else k, k, v, g, beta, state, out, n if n is not None else state, t, hk, hv, dk, dv,
        dk**-0.5, DK=pow2(dk), BV=VALUE_BLOCK, COUNT=n is not None, OUT=q is not None, STORE=store,
        num_warps=1,
    )  # fmt: skip
    return out


@delta_rule.register_fake
def _(q, k, v, g, beta, state, n, store=True):
    return v.new_empty(v.shape) if q is not None else v.new_empty(0)
