"""An attention layer's q and K/V rows in the static engine: projections, q/k norms, rotary, K/V writes.

`qkv_store` projects x through the layer's fused q/k/v (or k/v alone: the drafter's context), norms and rotates
q and k, and writes k and v into the layer's static buffers at tensor positions; with `kernel` all of it after
the projection is one kernel (`ops.fused.rope_store`), for the layers `rope_kernel` accepts. `QKVOptions` holds
what a layer declares beyond Llama's attention (gated q heads, norms over all heads, value norms, KV sharing).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dflash_zoo.cuda.ops import fused
from dflash_zoo.cuda.static.layout import LayerModules
from dflash_zoo.cuda.static.linear import FusedLinear
from dflash_zoo.cuda.static.lookup import norm_eps
from dflash_zoo.cuda.static.norms import Norms
from dflash_zoo.engine.rope import apply_rotary


@dataclass(frozen=True)
class QKVOptions:
    """How one attention layer's projections become q and K/V rows (the defaults: Llama / Qwen3)."""

    gated: bool = False  # q's projection emits [query | gate] per head; (q, gate) is returned
    per_head: bool = True  # the q/k norms run per head (False: over all heads at once, before the split)
    v_norm: nn.Module | None = None  # a norm on the values
    shared: bool = False  # a KV-shared layer: q only, nothing written
    # no v projection where `proj` yields q and k only: the values are then the key projection (Gemma 4)


PLAIN = QKVOptions()
GATED = QKVOptions(gated=True)  # Qwen3.5 / Qwen3-Next: [query | gate] per q head, and nothing else


def rope_kernel(m: LayerModules, opts: QKVOptions, eps: float) -> bool:
    """Whether `fused.rope_store` computes attention layer `m`'s q and K/V: its own K/V, per-head q/k norms
    of the declared formula (or none, as gpt-oss's), plain or gated q heads, a v projection or values that are
    the keys (Gemma 4's global layers), and a value norm, if any, without a weight (Gemma 4's)."""
    if m.q is None or opts.shared or not opts.per_head:
        return False
    vn = opts.v_norm
    return vn is None or (getattr(vn, "weight", None) is None and norm_eps(vn) == eps)


def qkv_store(
    proj: FusedLinear, x, heads: int, norm: Norms, qk, rope, positions, buffers, kernel: bool,
    opts: QKVOptions = PLAIN,
):  # fmt: skip
    """x [1, T, H] through `proj` (q/k/v, or k/v alone with heads 0) -> q [1, heads, T, hd], normed by the
    `qk` modules (q_norm, k_norm; None: no qk norm) and rotated by `rope` (cos, sin); None with heads 0. k is
    normed and rotated the same way and written with v into `buffers` ([1, kvh, S, hd] each) at `positions`.
    `kernel`: all of it in one kernel (`fused.rope_store`; layers `rope_kernel` accepts). `opts`: the
    layer's extras."""
    (cos, sin), (k_buf, v_buf) = rope, buffers
    if kernel:
        w = (qk[0].weight, qk[1].weight) if qk else (None, None)
        # one row (an FP8 weight: a block's rows too): the kernel's partial sums [splits, T, width], summed by
        # the rope kernel (not gated: the gates are read from qkv below); else the projection [T, width]
        sums = proj.parts(x, block=True) if not opts.gated else None
        qkv = sums if sums is not None else proj.joint(x)[0]
        k_eq_v = heads > 0 and len(proj.sizes) == 2  # q and k only: the values are the keys
        q = fused.rope_store(
            qkv, *w, cos, sin, positions, k_buf[0], v_buf[0], heads, norm.eps, opts.gated, norm.fp32, norm.offset,
            opts.v_norm is not None, k_eq_v, sums is not None,
        )  # fmt: skip
        q = q[None] if heads else None
        if not opts.gated:
            return q
        hd = k_buf.shape[-1]  # the gates, left in qkv: [1, T, heads, hd], strided
        return q, qkv[:, : 2 * heads * hd].view(1, -1, heads, 2, hd)[:, :, :, 1]
    t, hd = x.shape[1], k_buf.shape[-1]
    outs = list(proj(x))  # [1, T, width] each: q (with heads), then k and v unless shared
    q = outs.pop(0) if heads else None
    k = v = None
    if not opts.shared:
        k = outs.pop(0)
        v = outs.pop(0) if outs else k  # no v projection: the values are the keys, before their norm
    qn, kn = qk if qk else (None, None)
    if qk and not opts.per_head:  # one norm over every head's dims at once, before the split
        q = None if q is None else norm(qn, q)
        k = None if k is None else norm(kn, k)  # v (the keys, where there is no v projection) stays un-normed
        qn = kn = None
    gate = None
    if q is not None:
        q = q.view(1, t, -1, hd)  # [1, T, heads (x2 gated), hd]
        if opts.gated:  # per head [query (hd) | gate (hd)]
            q, gate = q.reshape(1, t, heads, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(1, t, -1)
        q = apply_rotary((norm(qn, q) if qn is not None else q).transpose(1, 2), cos, sin)
    if k is not None:
        k, v = k.view(1, t, -1, hd), v.view(1, t, -1, hd)  # [1, T, kvh, hd]
        k = norm(kn, k) if kn is not None else k
        v = norm(opts.v_norm, v) if opts.v_norm is not None else v
        k_buf.index_copy_(2, positions, apply_rotary(k.transpose(1, 2), cos, sin))
        v_buf.index_copy_(2, positions, v.transpose(1, 2))  # [1, kvh, T, hd]
    return (q, gate) if opts.gated else q
