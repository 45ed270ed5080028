"""Triton kernels for the elementwise work between a step's GEMMs (`FastOptions.fused_ops`).

Why: in a CUDA-graphed step every kernel costs ~2 us whatever it does, and at several rows (a 16-row verify or
draft) the views out of a fused projection are strided, so torch runs the small ops through its generic,
non-vectorised path. Profiled on the demo pair on an H200 (docs/performance.md), 193 such kernels took 389 of
a DFlash step's 841 us of kernel time. Three kernels take their place:
- `rope_store`: a layer's q/k/v rows from one fused projection -> q RMSNorm'd and rotated; k the same and
  written into the K cache; v written into the V cache (~16 kernels a layer: two norms, two weight products,
  rotate_half's negation and concatenation, three products, a sum, two index copies);
- `rms_norm`: `weight * rms_norm(x)` (torch's norm kernel plus a broadcast product), or the fp32-weight
  formulas of gpt-oss, Gemma 4 and Qwen3.5 (~7 kernels of their norm modules);
  and as `add_rms_norm` a residual add first (of a sublayer's output, or of a GEMV's partial sums, summed), so
  the add needs no kernel of its own and the norm reads the sum once;
- `silu_mul`: `silu(gate) * up` over the strided halves of a fused gate/up projection.
Each op is rounded to the dtype where torch rounds it (the norm to the dtype, then the weight product; each
rotary product, then their sum; SiLU, then the product), so in fp16 they equal the torch ops bitwise except
where a norm's fp32 sum, added in another order, differs in its last bit.

Torch custom ops (opaque to `torch.compile`, captured by CUDA graphs), on CUDA or under Triton's interpreter
(`TRITON_INTERPRET=1`, CPU tests); triton is imported on first use only.
"""

from __future__ import annotations

import functools

import torch

from dflash_zoo.cuda.ops.runtime import launch_mode, pow2


@functools.cache
def _kernels():
    from dflash_zoo.cuda.ops import fused_kernels as k  # triton on first use only

    return k.rope_store, k.rms_norm, k.silu_mul


@torch.library.custom_op("dflash_zoo::rope_store", mutates_args=("k_cache", "v_cache"))
def rope_store(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    eps: float,
    gated: bool = False,
    fp32_weight: bool = False,
    offset: float = 0.0,
    v_norm: bool = False,
    k_eq_v: bool = False,
    parts: bool = False,
) -> torch.Tensor:
    """qkv [T, (heads + 2 kvh) * hd]: q, k, v projections side by side (heads 0: k and v only); `gated`: each
    q head is [query | gate] (2 hd wide; the gates are left in qkv); `k_eq_v`: no v projection ([T, (heads +
    kvh) * hd]), the values are the keys before their norm. cos, sin [T, rot]; positions [T]; k_cache, v_cache
    [kvh, S, hd]. With norm weights [hd] (both or neither), q and k are RMSNorm'd first, in Llama's formula or
    with `fp32_weight` `rms_norm`'s fp32 one; `v_norm`: v too, without a weight (in fp32, rounded once).
    Writes k (rotated) and v at `positions`; returns q rotated, [heads, T, hd]. With `parts`, qkv is the fp32
    partial sums [splits, T, width] of its GEMV (`gemv.gemv_parts`), summed and rounded to the caches' dtype
    first (not with `gated`: its gates are read from qkv later)."""
    kvh, keys, hd = k_cache.shape
    if parts and (gated or qkv.dim() != 3):
        raise ValueError("partial sums [splits, T, width] of an ungated projection only")
    splits = qkv.shape[0] if parts else 1
    t, qspan = qkv.shape[-2], 2 * hd if gated else hd
    kv_width = (1 if k_eq_v else 2) * kvh * hd
    if qkv.shape[-1] != heads * qspan + kv_width:
        raise ValueError(
            f"qkv width {qkv.shape[-1]} is not {heads} x {qspan} + {1 if k_eq_v else 2} x {kvh} x {hd}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_store writes into contiguous [kvh, S, hd] caches only")
    qkv, cos, sin, positions = qkv.contiguous(), cos.contiguous(), sin.contiguous(), positions.contiguous()
    q = k_cache.new_empty(heads, t, hd)
    norm = q_weight is not None
    qw, kw = (q_weight, k_weight) if norm else (qkv, qkv)  # unread without NORM
    _kernels()[0][(t, heads + 2 * kvh)](
        qkv, qw, kw, cos, sin, positions, q, k_cache, v_cache, t, qkv.shape[-1], keys, heads, kvh, hd,
        cos.shape[-1], eps, qspan, offset, splits, D=pow2(hd), NORM=norm, FP32_WEIGHT=fp32_weight, V_NORM=v_norm,
        K_EQ_V=k_eq_v, PARTS=parts, **launch_mode(qkv),
    )  # fmt: skip
    return q


@rope_store.register_fake
def _(qkv, q_weight, k_weight, cos, sin, positions, k_cache, v_cache, heads, eps, gated=False, fp32_weight=False,
      offset=0.0, v_norm=False, k_eq_v=False, parts=False):  # fmt: skip
    return k_cache.new_empty(heads, qkv.shape[-2], k_cache.shape[-1])


def _norm_launch(x, delta, bias, weight, gate, total, y, eps, fp32_weight, offset, gated: bool, parts: bool,
                 more: torch.Tensor | None = None, post: float = 1.0):  # fmt: skip
    """One `rms_norm` program per row; with `delta` the residual add first (into `total`)."""
    n = x.shape[-1]
    d = pow2(n)
    add = delta is not None
    _kernels()[1][(x.numel() // n,)](
        x, delta if add else x, more if more is not None else x, bias if bias is not None else weight, weight, gate,
        total if add else y, y, n, delta.shape[0] if parts else 1, more.shape[0] if more is not None else 0, eps,
        offset, post, D=d, FP32_WEIGHT=fp32_weight, GATED=gated, ADD=add, PARTS=parts, MORE=more is not None,
        BIAS=bias is not None, POST=post != 1.0, num_warps=4 if d <= 2048 else 8, **launch_mode(x),
    )  # fmt: skip


@torch.library.custom_op("dflash_zoo::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    fp32_weight: bool = False,
    offset: float = 0.0,
    gate: torch.Tensor | None = None,
    post: float = 1.0,
) -> torch.Tensor:
    """x [..., n] -> RMSNorm [..., n]; weight [n]. Llama's formula, weight * normed(x).to(dtype) (`static.norms`),
    or with `fp32_weight` (normed(x) * (offset + weight)).to(dtype), all in fp32: gpt-oss and Gemma 4 (offset 0),
    Qwen3.5 / Qwen3-Next (offset 1, their zero-centred weights). With `gate` [..., n] the result is then
    multiplied by silu(gate) in fp32 and rounded (the gated norm of Gated-DeltaNet layers); with `post`, by
    that constant and rounded again (Gemma 4's router input: a weightless norm, times a scale, times H^-1/2)."""
    x, weight = x.contiguous(), weight.contiguous()
    g = gate.contiguous() if gate is not None else x
    y = torch.empty_like(x)
    _norm_launch(
        x, None, None, weight, g, None, y, eps, fp32_weight, offset, gate is not None, False, post=post
    )
    return y


@rms_norm.register_fake
def _(x, weight, eps, fp32_weight=False, offset=0.0, gate=None, post=1.0):
    return torch.empty_like(x)


@torch.library.custom_op("dflash_zoo::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [..., n] each, rows of either possibly strided (halves of one projection)."""
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)  # views for a fused projection's halves
    if g.stride(-1) != 1 or u.stride(-1) != 1:
        g, u = g.contiguous(), u.contiguous()
    y = gate.new_empty(g.shape)
    block = min(1024, pow2(n))
    _kernels()[2][(g.shape[0], -(-n // block))](g, u, y, n, g.stride(0), u.stride(0), BLOCK=block)
    return y.view(gate.shape)


@silu_mul.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


def check_sums(sums: torch.Tensor, like: torch.Tensor) -> None:
    """Partial sums [splits, rows, n] (`gemv.gemv_parts`) must be of the rows of `like` [..., n]."""
    if sums.dim() != 3 or sums[0].numel() != like.numel():
        raise ValueError(f"partial sums {list(sums.shape)} are not of rows like {list(like.shape)}")


@torch.library.custom_op("dflash_zoo::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    fp32_weight: bool = False,
    offset: float = 0.0,
    parts: bool = False,
    bias: torch.Tensor | None = None,
    more: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] + delta -> (the sum [..., n], its RMSNorm as `rms_norm` computes it). delta is [..., n] like
    x, or with `parts` the fp32 partial sums [splits, rows, n] of a few-row GEMV (`gemv.gemv_parts`), added
    in order with those of `more` (another such group) and `bias`, and rounded to x's dtype first, as
    `gemv.gemv` would return them."""
    x, weight, delta = x.contiguous(), weight.contiguous(), delta.contiguous()
    for sums in (delta, more) if parts else ():
        if sums is not None:
            check_sums(sums, x)
    if more is not None and not parts:
        raise ValueError("`more` partial sums go with `parts`")
    more = more.contiguous() if more is not None else None
    total, y = torch.empty_like(x), torch.empty_like(x)
    _norm_launch(x, delta, bias, weight, x, total, y, eps, fp32_weight, offset, False, parts, more)
    return total, y


@add_rms_norm.register_fake
def _(x, delta, weight, eps, fp32_weight=False, offset=0.0, parts=False, bias=None, more=None):
    return torch.empty_like(x), torch.empty_like(x)
