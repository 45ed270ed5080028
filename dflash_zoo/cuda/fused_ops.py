"""Triton kernels for the elementwise work between a step's GEMMs (`FastEngine(fused_ops=True)`).

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

from dflash_zoo.cuda.kernels import _pow2


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_store(QKV, QW, KW, Cos, Sin, Pos, Q, K, V, rows, width, keys, heads, kvh, hd, rot, eps, qspan,
                   offset, D: tl.constexpr, NORM: tl.constexpr, FP32_WEIGHT: tl.constexpr, V_NORM: tl.constexpr,
                   K_EQ_V: tl.constexpr):  # fmt: skip
        t, j = tl.program_id(0), tl.program_id(1)  # row; head slot: q heads, then k heads, then v heads
        d = tl.arange(0, D)
        dok = d < hd
        col = tl.where(j < heads, j * qspan, heads * qspan + (j - heads) * hd)  # q heads may span [query | gate]
        if K_EQ_V:  # no v projection: a V head reads its K head's columns
            col = tl.where(j >= heads + kvh, col - kvh * hd, col)
        x = tl.load(QKV + t * width + col + d, mask=dok, other=0.0)
        pos = tl.load(Pos + t)
        if j >= heads + kvh:  # a V head: stored as it is, or RMSNorm'd without a weight (fp32, rounded once)
            if V_NORM:
                xf = x.to(tl.float32)
                x = (xf / tl.sqrt(tl.sum(xf * xf, 0) / hd + eps)).to(x.dtype)
            tl.store(V + ((j - heads - kvh) * keys + pos) * hd + d, x, mask=dok)
        else:
            half = rot // 2
            pd = tl.where(d < half, d + half, d - half)  # rotate_half's partner of each rotated dim
            xp = tl.load(QKV + t * width + col + pd, mask=dok & (d < rot), other=0.0)
            xf, xpf = x.to(tl.float32), xp.to(tl.float32)
            if NORM:  # the q/k norm in the declared formula (as `rms_norm`), per head
                r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hd + eps)
                if j < heads:
                    w = tl.load(QW + d, mask=dok, other=0.0).to(tl.float32)
                    wp = tl.load(QW + pd, mask=dok, other=0.0).to(tl.float32)
                else:
                    w = tl.load(KW + d, mask=dok, other=0.0).to(tl.float32)
                    wp = tl.load(KW + pd, mask=dok, other=0.0).to(tl.float32)
                if FP32_WEIGHT:  # normed * (offset + weight) in fp32, rounded once
                    xf = (xf * r * (w + offset)).to(x.dtype).to(tl.float32)
                    xpf = (xpf * r * (wp + offset)).to(x.dtype).to(tl.float32)
                else:  # Llama: the norm rounded to the dtype, then the weight product
                    xf = ((xf * r).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
                    xpf = ((xpf * r).to(x.dtype).to(tl.float32) * wp).to(x.dtype).to(tl.float32)
            # x * cos + rotate_half(x) * sin, each product rounded; dims past `rot` pass (cos 1, sin 0)
            c = tl.load(Cos + t * rot + d, mask=d < rot, other=1.0).to(tl.float32)
            s = tl.load(Sin + t * rot + d, mask=d < rot, other=0.0).to(tl.float32)
            a = (xf * c).to(x.dtype).to(tl.float32)
            b = (xpf * s).to(x.dtype).to(tl.float32)
            y = (a + tl.where(d < half, -b, b)).to(x.dtype)
            if j < heads:
                tl.store(Q + (j * rows + t) * hd + d, y, mask=dok)
            else:
                tl.store(K + ((j - heads) * keys + pos) * hd + d, y, mask=dok)

    @triton.jit
    def rms_norm(X, Dl, Dm, B, W, G, S, Y, n, splits, more, eps, offset, post, D: tl.constexpr,
                 FP32_WEIGHT: tl.constexpr, GATED: tl.constexpr, ADD: tl.constexpr, PARTS: tl.constexpr,
                 MORE: tl.constexpr, BIAS: tl.constexpr, POST: tl.constexpr):  # fmt: skip
        row, d = tl.program_id(0), tl.arange(0, D)
        ok = d < n
        x = tl.load(X + row * n + d, mask=ok, other=0.0)
        if ADD:  # x + delta first (the residual sum, rounded as torch's add), written to S, then its norm
            if PARTS:  # a split-K GEMV's fp32 partial sums [splits, rows, n]: added in order, plus bias, rounded
                acc = tl.zeros([D], tl.float32)
                for s0 in range(0, splits, 4):  # four slices' loads in flight at once (unrolled), added in order
                    for s1 in tl.static_range(4):
                        sp = s0 + s1
                        at = Dl + (sp * tl.num_programs(0) + row) * n + d
                        acc += tl.load(at, mask=ok & (d * 0 + sp < splits), other=0.0)
                if MORE:  # a second group of partial sums [more, rows, n] (a shared expert's), after the first
                    for sp in range(0, more):
                        acc += tl.load(Dm + (sp * tl.num_programs(0) + row) * n + d, mask=ok, other=0.0)
                if BIAS:
                    acc += tl.load(B + d, mask=ok, other=0.0).to(tl.float32)
                delta = acc.to(x.dtype)
            else:
                delta = tl.load(Dl + row * n + d, mask=ok, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
            tl.store(S + row * n + d, x, mask=ok)
        xf = x.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
        w = tl.load(W + d, mask=ok, other=0.0).to(tl.float32)
        if FP32_WEIGHT:  # (normed * (offset + weight)) in fp32, rounded once
            y = (xf * r * (w + offset)).to(x.dtype)
        else:  # Llama: the norm rounded to the dtype, then the weight product
            y = ((xf * r).to(x.dtype).to(tl.float32) * w).to(x.dtype)
        if GATED:  # times silu(gate) in fp32, rounded once (Qwen3.5's gated norm)
            g = tl.load(G + row * n + d, mask=ok, other=0.0).to(tl.float32)
            y = (y.to(tl.float32) * (g / (1.0 + tl.exp(-g)))).to(x.dtype)
        if POST:  # then times a constant, rounded (Gemma 4's router input)
            y = (y.to(tl.float32) * post).to(x.dtype)
        tl.store(Y + row * n + d, y, mask=ok)

    @triton.jit
    def silu_mul(G, U, Y, n, g_stride, u_stride, BLOCK: tl.constexpr):
        row, cols = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        g = tl.load(G + row * g_stride + cols, mask=ok, other=0.0)
        u = tl.load(U + row * u_stride + cols, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu, rounded as torch's
        tl.store(Y + row * n + cols, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)

    return rope_store, rms_norm, silu_mul


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
) -> torch.Tensor:
    """qkv [T, (heads + 2 kvh) * hd]: q, k, v projections side by side (heads 0: k and v only); `gated`: each
    q head is [query | gate] (2 hd wide; the gates are left in qkv); `k_eq_v`: no v projection ([T, (heads +
    kvh) * hd]), the values are the keys before their norm. cos, sin [T, rot]; positions [T]; k_cache, v_cache
    [kvh, S, hd]. With norm weights [hd] (both or neither), q and k are RMSNorm'd first, in Llama's formula or
    with `fp32_weight` `rms_norm`'s fp32 one; `v_norm`: v too, without a weight (in fp32, rounded once).
    Writes k (rotated) and v at `positions`; returns q rotated, [heads, T, hd]."""
    kvh, keys, hd = k_cache.shape
    t, qspan = qkv.shape[0], 2 * hd if gated else hd
    kv_width = (1 if k_eq_v else 2) * kvh * hd
    if qkv.shape[1] != heads * qspan + kv_width:
        raise ValueError(f"qkv width {qkv.shape[1]} is not {heads} x {qspan} + {1 if k_eq_v else 2} x {kvh} x {hd}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_store writes into contiguous [kvh, S, hd] caches only")
    qkv, cos, sin, positions = qkv.contiguous(), cos.contiguous(), sin.contiguous(), positions.contiguous()
    q = qkv.new_empty(heads, t, hd)
    norm = q_weight is not None
    qw, kw = (q_weight, k_weight) if norm else (qkv, qkv)  # unread without NORM
    _kernels()[0][(t, heads + 2 * kvh)](
        qkv, qw, kw, cos, sin, positions, q, k_cache, v_cache, t, qkv.shape[1], keys, heads, kvh, hd,
        cos.shape[-1], eps, qspan, offset, D=_pow2(hd), NORM=norm, FP32_WEIGHT=fp32_weight, V_NORM=v_norm,
        K_EQ_V=k_eq_v,
    )  # fmt: skip
    return q


@rope_store.register_fake
def _(qkv, q_weight, k_weight, cos, sin, positions, k_cache, v_cache, heads, eps, gated=False, fp32_weight=False,
      offset=0.0, v_norm=False, k_eq_v=False):  # fmt: skip
    return qkv.new_empty(heads, qkv.shape[0], k_cache.shape[-1])


def _norm_launch(x, delta, bias, weight, gate, total, y, eps, fp32_weight, offset, gated: bool, parts: bool,
                 more: torch.Tensor | None = None, post: float = 1.0):  # fmt: skip
    """One `rms_norm` program per row; with `delta` the residual add first (into `total`)."""
    n = x.shape[-1]
    d = _pow2(n)
    add = delta is not None
    _kernels()[1][(x.numel() // n,)](
        x, delta if add else x, more if more is not None else x, bias if bias is not None else weight, weight, gate,
        total if add else y, y, n, delta.shape[0] if parts else 1, more.shape[0] if more is not None else 0, eps,
        offset, post, D=d, FP32_WEIGHT=fp32_weight, GATED=gated, ADD=add, PARTS=parts, MORE=more is not None,
        BIAS=bias is not None, POST=post != 1.0, num_warps=4 if d <= 2048 else 8,
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
    """x [..., n] -> RMSNorm [..., n]; weight [n]. Llama's formula, weight * normed(x).to(dtype) (`static._Norms`),
    or with `fp32_weight` (normed(x) * (offset + weight)).to(dtype), all in fp32: gpt-oss and Gemma 4 (offset 0),
    Qwen3.5 / Qwen3-Next (offset 1, their zero-centred weights). With `gate` [..., n] the result is then
    multiplied by silu(gate) in fp32 and rounded (the gated norm of Gated-DeltaNet layers); with `post`, by
    that constant and rounded again (Gemma 4's router input: a weightless norm, times a scale, times H^-1/2)."""
    x, weight = x.contiguous(), weight.contiguous()
    g = gate.contiguous() if gate is not None else x
    y = torch.empty_like(x)
    _norm_launch(x, None, None, weight, g, None, y, eps, fp32_weight, offset, gate is not None, False, post=post)
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
    block = min(1024, _pow2(n))
    _kernels()[2][(g.shape[0], -(-n // block))](g, u, y, n, g.stride(0), u.stride(0), BLOCK=block)
    return y.view(gate.shape)


@silu_mul.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


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
        if sums is not None and sums[0].numel() != x.numel():
            raise ValueError(f"partial sums {list(sums.shape)} are not of rows like {list(x.shape)}")
    if more is not None and not parts:
        raise ValueError("`more` partial sums go with `parts`")
    more = more.contiguous() if more is not None else None
    total, y = torch.empty_like(x), torch.empty_like(x)
    _norm_launch(x, delta, bias, weight, x, total, y, eps, fp32_weight, offset, False, parts, more)
    return total, y


@add_rms_norm.register_fake
def _(x, delta, weight, eps, fp32_weight=False, offset=0.0, parts=False, bias=None, more=None):
    return torch.empty_like(x), torch.empty_like(x)
