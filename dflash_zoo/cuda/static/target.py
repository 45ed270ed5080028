"""Static-shape forwards for the fast path: the target and the drafter over pre-allocated K/V buffers.

- `StaticTarget`: an own forward over the target's HF modules (norms, q/k/v/o projections, MLP, rotary
  embedding), found through the names its adapter declares (`static_layout`, resolved in layout.py), writing
  K/V at tensor positions into [1, kvh, S, hd] buffers (attention.py runs the attention). Rollback is a
  position counter: rejected rows stay, masked, until overwritten; Gated-DeltaNet layers keep static states
  that a commit moves on (gdn.py). A sparse MoE block runs as its declared parts: the routing rule's kernel
  (or the router module) and, for steps of at most `moe_rows` rows, the routed experts through the MoE kernels
  (moe.py); longer steps call the experts module, captured in a CUDA graph only where its implementation does
  not sync with the host (layout.py).
- `StaticDrafter`: the DFlash drafter (drafter.py modules) over a static context K/V buffer; the block's own
  K/V are written as scratch rows just past the context, so nothing is concatenated per step.
Every shape is fixed for a given block, so a step can be captured in a CUDA graph (fast.py).

Fewer kernels per layer (each costs ~2.5 us inside a graph on an H200, docs/performance.md):
- `fuse=True`: q/k/v and gate/up run as one GEMM each over row-concatenated weights (`FusedLinear`); the
  modules' own weights become views into the fused tensor, so memory does not grow and HF's forward still works;
- `fast_norm=True`: RMSNorm as `weight * F.rms_norm(x)`: bit-identical to HF's Qwen3/Llama RMSNorm on CPU in
  fp32 and bf16 (the weight multiply stays outside, in the input dtype, as HF does), in 2 kernels instead of ~7.
- `"split"` attention and `gemv=True`: the Triton kernels of kernels.py and gemv.py (split-KV attention for any
  step, a split-K GEMV, timed against cuBLAS, for one-row projections); `fused_ops=True`: those of fused_ops.py (q/k
  norm + rotary + K/V write, RMSNorm with its weight, SiLU-gated product: one kernel each), and each residual
  add inside the next norm's kernel (`_Norms.add`), which also sums a one-row o / down GEMV's partial sums;
  a sandwich-norm layer's residual adds with all their norms in one kernel each (sandwich.py).

Longer than the ~300 lines we aim for: the static target and drafter forwards share their norm and projection
helpers, and the target's layer recipe covers every declared family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_zoo.cuda.ops import fused as fused_ops
from dflash_zoo.cuda.ops import gemv as gemv_ops
from dflash_zoo.cuda.ops import moe, sandwich
from dflash_zoo.cuda.ops.attention import (
    BLOCK_ATTENTION,
    DECODE_ATTENTION,
    _group_mask,
    _grouped_sinks,
    _grouped_split,
)
from dflash_zoo.cuda.static.gdn import StaticGDN
from dflash_zoo.cuda.static.layout import MoEParts, graph_unsafe_reason, layout_reason, norm_eps, resolve
from dflash_zoo.engine.rope import apply_rotary

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import TargetAdapter


def unsupported_reason(adapter: TargetAdapter, graphs: bool = False) -> str | None:
    """Why the fast engine cannot run this target (None: it can); `graphs`: its steps are to be CUDA graphs.

    Decoding modes never decide it: greedy and sampling run the same captured steps.
    """
    reason = layout_reason(adapter)  # no declared static layout, or layer types it does not cover
    if reason:
        return reason
    return graph_unsafe_reason(adapter) if graphs else None


# ---- fused projections -------------------------------------------------------------------------------
def _back_to_back(parts: list[torch.Tensor]) -> bool:
    """Whether `parts` already lie contiguously, in order, in one storage (an earlier fuse): a view covers them."""
    ptr, offset = parts[0].untyped_storage().data_ptr(), parts[0].storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != ptr or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


def _fuse_param(linears: list[nn.Linear], name: str) -> torch.Tensor | None:
    parts = [getattr(m, name, None) for m in linears]  # name: "weight" or "bias"
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError(f"cannot fuse projections of which only some have a {name}")
    rows = sum(p.shape[0] for p in parts)
    if _back_to_back(parts):  # fused by an earlier engine: view, do not copy again
        return parts[0].detach().as_strided((rows, *parts[0].shape[1:]), parts[0].stride())
    fused = torch.cat([p.detach() for p in parts])  # [sum(out), in] or [sum(out)]
    start = 0
    for m, p in zip(linears, parts, strict=True):
        # Parameter reassignment, not a patch: same module, same name, its data now a row view of `fused`;
        # the old storage is freed, so the fused copy costs no memory and the HF forward still works.
        setattr(m, name, nn.Parameter(fused[start : start + p.shape[0]], requires_grad=p.requires_grad))
        start += p.shape[0]
    return fused


class FusedLinear:
    """Row-concatenated projections (q/k/v or gate/up) run as one GEMM and split back into their outputs.

    With `fuse=False` the modules run one by one (the unfused baseline). Built under `no_grad` and outside
    inference mode, so the modules stay trainable (gradients reach each view Parameter).
    """

    def __init__(self, linears: list[nn.Module], fuse: bool = True, gemv: bool = False):
        self.sizes = [m.weight.shape[0] for m in linears]  # linears, or a router module with a [E, H] weight
        self.linears = None if fuse else linears
        self.gemv = gemv and fuse  # few rows through `gemv_ops.gemv` (its kernels or cuBLAS, as timed faster)
        self.weight = self.bias = None
        if fuse:
            with torch.inference_mode(False), torch.no_grad():
                self.weight, self.bias = _fuse_param(linears, "weight"), _fuse_param(linears, "bias")

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> one [..., out_j] per projection (views into one GEMM output when fused)."""
        if self.linears is not None:
            return tuple(m(x) for m in self.linears)
        return self.joint(x).split(self.sizes, dim=-1)

    def parts(self, x: torch.Tensor) -> torch.Tensor | None:
        """One row x [..., in] -> the fp32 partial sums [splits, 1, sum(out_j)] of the fused GEMV (`gemv_parts`),
        for a kernel that sums them as it reads them; None where that does not apply (unfused, a bias, GEMV off,
        several rows, or traced: the slice count is tuned at run time)."""
        one_row = x.numel() == x.shape[-1]
        if self.linears is not None or self.bias is not None or not self.gemv or not one_row:
            return None
        return None if torch.compiler.is_compiling() else gemv_ops.gemv_parts(x, self.weight, None)

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., sum(out_j)]: the outputs side by side (one GEMM when fused)."""
        if self.linears is not None:
            return torch.cat([m(x) for m in self.linears], dim=-1)
        return _linear(x, self.weight, self.bias, self.gemv)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: bool) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T + bias: for a few rows with `gemv` through `gemv_ops.gemv` (its kernels or
    cuBLAS, as timed faster), else cuBLAS."""
    if gemv and x.numel() // x.shape[-1] <= gemv_ops.max_rows():
        return gemv_ops.gemv(x, weight, bias, None)
    return F.linear(x, weight, bias)


# `StaticLayout.norms` formulas that are not Llama's: (weight multiplied in fp32, offset added to the weight)
FP32_NORMS = {"fp32_weight": 0.0, "fp32_one_plus_weight": 1.0}


class _Norms:
    """RMSNorm over HF / drafter norm modules: the module itself, or `weight * F.rms_norm(x)` (same numerics),
    or the declared formula in one kernel (`fused_ops.rms_norm`, `kernel`)."""

    def __init__(self, eps: float, fast: bool, kernel: bool = False, formula: str = "llama"):
        self.eps, self.fast, self.kernel = eps, fast, kernel
        self.fp32 = formula in FP32_NORMS
        self.offset = FP32_NORMS.get(formula, 0.0)

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = getattr(module, "weight", None)  # a weightless norm (Gemma's value norm) runs as its module
        if self.kernel and weight is not None and weight.dtype == x.dtype:
            eps = norm_eps(module, self.eps)
            return fused_ops.rms_norm(x, weight, eps, self.fp32, self.offset)
        if not self.fast:
            return module(x)
        # HF: weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype); rms_norm without a weight returns that
        # cast value, and the weight multiply stays in the input dtype (folding it in would round differently)
        return module.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps)

    def fuses(self, module: nn.Module | None, dtype: torch.dtype) -> bool:
        """Whether `add` runs as one kernel for this norm module and dtype."""
        weight = getattr(module, "weight", None)
        return self.kernel and weight is not None and weight.dtype == dtype

    def add(self, module: nn.Module, x: torch.Tensor, delta: torch.Tensor | Parts | None):
        """(x + delta, the norm of that sum); delta None: (x, its norm). One kernel where `fuses`
        (`fused_ops.add_rms_norm`), which also sums a GEMV's `Parts`."""
        if delta is None:
            return x, self(module, x)
        if self.fuses(module, x.dtype):
            eps = norm_eps(module, self.eps)
            parts = isinstance(delta, Parts)
            d, bias, more = (delta.sums, delta.bias, delta.more) if parts else (delta, None, None)
            return fused_ops.add_rms_norm(x, d, module.weight, eps, self.fp32, self.offset, parts, bias, more)
        x = _plus(x, delta)
        return x, self(module, x)


@dataclass(frozen=True)
class Parts:
    """A few-row GEMV's output as its fp32 partial sums [splits, rows, N] (`gemv_ops.gemv_parts`), plus its bias:
    the residual add sums them in its own kernel (`_Norms.add`), so no kernel of its own adds them up."""

    sums: torch.Tensor
    bias: torch.Tensor | None
    more: torch.Tensor | None = None  # a second output's partial sums, added to the first (a shared expert's)

    def total(self, like: torch.Tensor) -> torch.Tensor:
        """The GEMV's output, shaped and typed like `like` (where no fused add takes the sums)."""
        y = self.sums.sum(0)
        for extra in (self.more.sum(0) if self.more is not None else None, self.bias):
            y = y if extra is None else y + extra.float()
        return y.to(like.dtype).view(like.shape)


def _summed(out: torch.Tensor | Parts, like: torch.Tensor) -> torch.Tensor:
    """`out` as a tensor (`Parts` summed, shaped and typed like `like`)."""
    return out.total(like) if isinstance(out, Parts) else out


def _plus(x: torch.Tensor, delta: torch.Tensor | Parts | None) -> torch.Tensor:
    """x + delta, as separate ops (where no fused add takes it)."""
    return x if delta is None else x + _summed(delta, x)


def _project(m: nn.Linear, x: torch.Tensor, gate: torch.Tensor | None, gemv: bool, fold: bool, act: int = 1):
    """m(x), or m(act(gate) * x) with `gate` (`act` of `gemv_ops.ACTS`), for a few rows through `gemv_ops.gemv`:
    for one row as `Parts` with `fold` (the next residual add sums them). None where the kernels do not apply
    (off, or too many rows)."""
    rows = x.numel() // x.shape[-1]
    if not gemv or rows > gemv_ops.max_rows():
        return None
    # gemv_parts' shape is tuned at run time: not traceable
    if fold and rows == 1 and not torch.compiler.is_compiling():
        return Parts(gemv_ops.gemv_parts(x, m.weight, gate, act=act), m.bias)
    return gemv_ops.gemv(x, m.weight, m.bias, gate, act)


def _logit(gate: nn.Module | None, like: nn.Linear) -> list[nn.Linear]:
    """[gate] where a shared expert's gate is a plain one-output linear with a bias where its gate/up projection
    `like` has one (fused beside them), else []."""
    ok = isinstance(gate, nn.Linear) and gate.out_features == 1
    return [gate] if ok and (gate.bias is None) == (like.bias is None) else []


def _router(p: MoEParts, moe_rows: int) -> list[nn.Module]:
    """[router] where a declared routing rule's kernel reads its logits (`StaticTarget._route`) from an [E, H]
    weight, fused beside the shared expert's bias-free gate/up (the same input), else []."""
    weight = getattr(p.router, "weight", None)
    ok = p.routing is not None and moe_rows and isinstance(weight, torch.Tensor) and weight.dim() == 2
    no_bias = getattr(p.router, "bias", None) is None and p.shared_mlp[0].bias is None
    return [p.router] if ok and no_bias else []


def _swiglu(act, gate: torch.Tensor, up: torch.Tensor, kernel: bool) -> torch.Tensor:
    """act(gate) * up; with `kernel` (act is SiLU), one kernel over the strided halves (`fused_ops.silu_mul`)."""
    return fused_ops.silu_mul(gate, up) if kernel else act(gate) * up


def _swiglu_mlp(owner, gate_up: FusedLinear, down: nn.Linear, act, x, fold: bool = False):
    """down(act(gate(x)) * up(x)) over x [..., H] with the switches of `owner` (a StaticTarget or StaticDrafter:
    `gemv`, `gate_act`, `swiglu`); for one row with `fold`, as `Parts`. One row through the GEMV kernels: the
    down kernel reads gate/up's partial sums itself (no kernel adds them up first)."""
    sums = gate_up.parts(x) if owner.gate_act and owner.gemv else None  # [S, 1, 2F] fp32
    if sums is None:
        return _swiglu_down(owner, *gate_up(x), down, act, fold)
    f, kind = down.in_features, owner.gate_act
    gate, up = sums[..., :f], sums[..., f:]
    if fold:  # (`parts` is None while traced)
        return Parts(gemv_ops.gemv_parts(up, down.weight, gate, act=kind, in_parts=True), down.bias)
    return gemv_ops.gemv(up, down.weight, down.bias, gate, kind, True).view(*x.shape[:-1], -1)


def _swiglu_down(owner, gate, up, down: nn.Linear, act, fold: bool = False):
    """down(act(gate) * up) for the gate and up outputs [..., F], as `_swiglu_mlp`."""
    # act(gate) * up computed inside the GEMV kernel, where it computes that activation
    projected = _project(down, up, gate, owner.gemv, fold, owner.gate_act) if owner.gate_act else None
    return down(_swiglu(act, gate, up, owner.swiglu)) if projected is None else projected


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


def _rope_kernel(m, opts: QKVOptions, eps: float) -> bool:
    """Whether `fused_ops.rope_store` computes attention layer `m`'s q and K/V: its own K/V, per-head q/k norms
    of the declared formula (or none, as gpt-oss's), plain or gated q heads, a v projection or values that are
    the keys (Gemma 4's global layers), and a value norm, if any, without a weight (Gemma 4's)."""
    if m.q is None or opts.shared or not opts.per_head:
        return False
    vn = opts.v_norm
    return vn is None or (getattr(vn, "weight", None) is None and norm_eps(vn) == eps)


def _qkv_store(
    proj, x, heads: int, norm, qk, rope, positions, buffers, fused: bool, opts: QKVOptions = PLAIN
):
    """x [1, T, H] through `proj` (q/k/v, or k/v alone with heads 0) -> q [1, heads, T, hd], normed by the
    `qk` modules (q_norm, k_norm; None: no qk norm) and rotated by `rope` (cos, sin); None with heads 0. k is
    normed and rotated the same way and written with v into `buffers` ([1, kvh, S, hd] each) at `positions`.
    `fused`: all of it in one kernel (`fused_ops.rope_store`; layers `_rope_kernel` accepts). `opts`: the
    layer's extras."""
    (cos, sin), (k_buf, v_buf) = rope, buffers
    if fused:
        w = (qk[0].weight, qk[1].weight) if qk else (None, None)
        # one row: the GEMV's partial sums [splits, 1, width], summed by the kernel (not gated: the gates are
        # read from qkv below); else the projection [T, width]
        sums = proj.parts(x) if not opts.gated else None
        qkv = sums if sums is not None else proj.joint(x)[0]
        k_eq_v = heads > 0 and len(proj.sizes) == 2  # q and k only: the values are the keys
        q = fused_ops.rope_store(
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


class StaticTarget:
    """The target's decoder over static K/V buffers [1, kvh, max_len, hd] per attention layer, and static
    conv / recurrent states per Gated-DeltaNet layer (gdn.py).

    Attention layers are full or sliding-window (a mask), optionally with sinks, biases, an output gate,
    value norms, values taken from the keys, K/V shared with an earlier layer, partial rotary and their own head
    size, as the adapter's layout declares; GDN layers keep their states until `commit`. Decoder layers are
    pre-norm residual blocks, optionally with sandwich norms, a parallel MoE branch, a per-layer input and an
    output scalar (Gemma).
    """

    def __init__(
        self,
        adapter: TargetAdapter,
        max_len: int,
        tap_ids: tuple[int, ...],
        fuse: bool = True,
        fast_norm: bool = True,
        decode_attention: str = "sdpa",
        block_attention: str = "sdpa",
        gemv: bool = False,
        fused_ops: bool = False,
        max_rows: int = 16,
        moe_rows: int = 0,
    ):
        self.adapter, self.model = adapter, adapter.model
        self.moe_rows = moe_rows  # steps of at most this many rows run routed experts through cuda/moe.py
        mods = resolve(adapter)  # every module through the adapter's `static_layout`
        self.layers, self.final_norm, self.rotary_emb = mods.layers, mods.final_norm, mods.rotary_emb
        layout, text = mods.layout, adapter.text_config
        self.halves, self.axes, self.by_type = (
            layout.rotary_halves,
            layout.rotary_axes,
            layout.rotary_by_layer_type,
        )
        self.gemv = gemv  # few-row projections through `gemv_ops.gemv` (split over K)
        llama = layout.norms == "llama"  # the declared RMSNorm formula (the norm kernel computes each)
        self.decode_attend = DECODE_ATTENTION[decode_attention]  # T = 1 steps only
        self.block_attend = BLOCK_ATTENTION[block_attention]  # verify steps (T > 1)
        self.silu = mods.activation == "silu"  # the kernels' fused SwiGLU
        self.gate_act = gemv_ops.ACTS.get(
            mods.activation, 0
        )  # the dense MLPs' activation in the GEMV (0: none)
        self.swiglu = fused_ops and self.silu  # silu(gate) * up through `fused_ops.silu_mul`
        self.heads = text.num_attention_heads
        if layout.norms != "llama" and layout.norms not in FP32_NORMS:
            raise ValueError(f"unknown norm formula {layout.norms!r} in the static layout")
        self.norm = _Norms(mods.eps, fast_norm and llama, fused_ops, layout.norms)
        self.taps: dict[int, list[int]] = {}  # layer id -> tap slots (ids may repeat)
        for slot, lid in enumerate(tap_ids):
            self.taps.setdefault(lid, []).append(slot)
        self.hidden = text.hidden_size
        self.dtype = mods.final_norm.weight.dtype
        # q/k/v as one GEMM; a KV-shared layer projects q alone, one whose values are its keys q and k
        self.qkv = [FusedLinear([p for p in (m.q, m.k, m.v) if p is not None], fuse, gemv) if m.q is not None
                    else None for m in self.layers]  # fmt: skip
        self.opts = [QKVOptions(m.output_gate, m.qk_norm_per_head, m.v_norm, m.kv_source is not None)
                     for m in self.layers]  # fmt: skip
        # q/k norm + rotary + K/V writes in one kernel where `_rope_kernel` accepts the layer
        self.rope_kernel = [
            fused_ops and _rope_kernel(m, o, mods.eps) for m, o in zip(self.layers, self.opts, strict=True)
        ]
        # GDN layers: their own static states; the input projections as one GEMM, split by the adapter
        self.gdn = [StaticGDN(m.gdn, m.gdn_parts, adapter.gdn_split, fused_ops, fuse, gemv) if m.gdn is not None
                    else None for m in self.layers]  # fmt: skip
        # dense MLPs only: a sparse MoE block runs as its module or its declared parts (`_sparse`): None here
        self.gate_up = [
            FusedLinear([m.gate, m.up], fuse, gemv) if m.gate is not None else None for m in self.layers
        ]
        # a sparse block's shared expert with dense projection names: fused the same way, with its one-logit gate
        # (where that is a plain linear, `_shared`) and its router's logits (`_route`) as further outputs
        self.shared_gate_up: list[FusedLinear | None] = [None] * len(self.layers)
        self.shared_extra: list[tuple[bool, bool]] = [(False, False)] * len(
            self.layers
        )  # (logit, router) fused
        for i, p in enumerate(m.moe_parts for m in self.layers):
            if p is not None and p.shared_mlp:
                logit, router = _logit(p.shared_gate, p.shared_mlp[0]), _router(p, moe_rows)
                self.shared_gate_up[i] = FusedLinear([*p.shared_mlp[:2], *logit, *router], fuse, gemv)
                self.shared_extra[i] = (bool(logit), bool(router))
        # sandwich-norm layers: each residual add, with its norms, in one kernel (sandwich.py)
        self.sandwich = [sandwich.runs(self, i) for i in range(len(self.layers))]
        # few-row o / down projections whose partial sums the next residual add takes (`Parts`): where that add
        # and norm run as one kernel and nothing else reads the sublayer's output first
        self.fold_o, self.fold_down = self._folds(mods.final_norm)
        dev = mods.final_norm.weight.device
        # sliding layers keep a ring of R >= window + 2 * max_rows slots (slot = position % R) where that is
        # shorter than the buffers: a verify's writes then only replace keys outside every live query's window
        # (also after a rollback), so the rows a later step needs are never overwritten early
        self.ring = [
            self._ring_size(m.window, max_rows, max_len) if m.q is not None else None for m in self.layers
        ]
        # per ring size: the position each slot holds (never written: far below any window)
        self.slot_pos = {
            r: torch.full((r,), -(2**40), dtype=torch.long, device=dev) for r in set(self.ring) if r
        }
        self.k, self.v = self._kv_buffers(max_len)
        self.group = [
            self.heads // k.shape[1] if k is not None else 0 for k in self.k
        ]  # query heads per K/V head
        self.key_pos = torch.arange(max_len, device=dev)  # [S]
        self._scratch: dict[int, tuple] = {}  # prefill only: full-prompt K/V of ring layers
        self.has_attention = any(q is not None for q in self.qkv)  # else no rotary tables to compute
        # layers whose prefill cannot use the causal flash kernel: windows and sinks need a mask
        self.masked_prefill = any(m.window is not None or m.sinks is not None for m in self.layers)
        self.per_layer = any(m.per_layer is not None for m in self.layers)  # per-layer inputs from the ids

    def _folds(self, final_norm) -> tuple[list[bool], list[bool]]:
        if not self.gemv:
            return [False] * len(self.layers), [False] * len(self.layers)
        fuses = [
            self.norm.fuses(n, self.dtype) for n in (*(m.input_norm for m in self.layers[1:]), final_norm)
        ]
        # an attention or GDN layer's output projection, summed by the next norm's kernel or the sandwich kernel
        o = [(q is not None or m.gdn is not None)
             and (m.attn_out_norm is None and self.norm.fuses(m.post_norm, self.dtype) or sandwich_layer)
             for q, m, sandwich_layer in zip(self.qkv, self.layers, self.sandwich, strict=True)]  # fmt: skip
        # a dense SwiGLU MLP's down GEMV, or a sparse block's routed experts and its shared expert, if any, where
        # that folds too (`_sparse`)
        sparse = [m.moe_parts is not None and (m.moe_parts.shared is None or self._shared_folds(i))
                  for i, m in enumerate(self.layers)]  # fmt: skip
        parts = [(g is not None and self.gate_act) or f for g, f in zip(self.gate_up, sparse, strict=True)]
        down = [  # the layer's residual sum is left to the next norm (`forward`), which fuses
            p and nxt and m.moe_branch is None and m.mlp_out_norm is None
            and i not in self.taps and m.per_layer is None and m.scalar is None
            for i, (p, m, nxt) in enumerate(zip(parts, self.layers, fuses, strict=True))
        ]  # fmt: skip
        return o, down

    @staticmethod
    def _ring_size(window: int | None, max_rows: int, max_len: int) -> int | None:
        """Slots of a sliding layer's ring (a multiple of 64, as the buffers), or None: a full-length buffer."""
        if window is None:
            return None
        size = -(-(window + 2 * max_rows) // 64) * 64
        return size if size < max_len else None

    def _kv_buffers(self, max_len: int) -> tuple[list, list]:
        """[1, kvh, S, hd] K and V per attention layer (its own sizes; S: max_len, or the ring's slots); a
        KV-shared layer's are its source layer's (it only reads them); None for GDN layers."""
        k: list[torch.Tensor | None] = [None] * len(self.layers)
        v: list[torch.Tensor | None] = [None] * len(self.layers)
        for i, m in enumerate(self.layers):
            if m.k is not None:
                w, rows = m.k.weight, self.ring[i] or max_len
                k[i] = torch.zeros(
                    1, m.k.out_features // m.head_dim, rows, m.head_dim, device=w.device, dtype=w.dtype
                )
                v[i] = torch.zeros_like(k[i])
        for i, m in enumerate(self.layers):
            if m.kv_source is not None:
                k[i], v[i] = k[m.kv_source], v[m.kv_source]
        return k, v

    def states(self) -> list[torch.Tensor]:
        """Tensors a step mutates in place besides K/V rows it rewrites itself (GDN states, ring slots)."""
        return [t for g in self.gdn if g is not None for t in g.states()] + list(self.slot_pos.values())

    def commit(self, n: torch.Tensor) -> None:
        """After a verify: the first `n` rows (0-d long tensor) were committed; GDN states move past them
        (attention needs nothing: rejected K/V rows stay masked until overwritten)."""
        for g in self.gdn:
            if g is not None:
                g.commit(n)

    def _attn(self, i: int, x, rope, positions, masks, prefill: bool):
        m, t, g, ring = self.layers[i], x.shape[1], self.group[i], self.ring[i]
        buffers, rows, key = (self.k[i], self.v[i]), positions, (m.window, g)
        if ring and prefill:  # the whole prompt's K/V (a prompt can be longer than the ring), then its tail
            src = i if m.kv_source is None else m.kv_source
            if src not in self._scratch:
                self._scratch[src] = tuple(b.new_zeros(*b.shape[:2], t, b.shape[-1]) for b in buffers)
            buffers = self._scratch[src]
        elif ring:
            rows, key = positions % ring, ("ring", ring, m.window, g)
        q = _qkv_store(self.qkv[i], x, self.heads, self.norm, m.qk_norm, rope, rows, buffers,
                       self.rope_kernel[i], self.opts[i])  # fmt: skip
        if ring and prefill and m.kv_source is None:
            kept = positions[-ring:]  # the last R prompt rows into their slots
            for ring_buf, full in zip((self.k[i], self.v[i]), buffers, strict=True):
                ring_buf.index_copy_(2, kept % ring, full[:, :, -ring:])
        q, gate = q if m.output_gate else (q, None)
        gmask = masks.get(key)
        if prefill and gmask is None:  # from position 0: causal flash kernel over the prompt, no mask tensor
            # the prompt's K/V heads from the buffers, repeated for the kernel (transient, one layer at a time)
            kk, vv = (b[:, :, :t].repeat_interleave(g, 1) for b in buffers)
            out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=m.scaling)
            out = out.transpose(1, 2).reshape(1, t, -1)
        else:
            k, v = (b[:, :, :t] for b in buffers) if prefill else buffers  # prefill: the prompt's keys only
            attend = self.decode_attend if t == 1 else self.block_attend
            if m.sinks is None:
                out = attend(q, k, v, gmask, m.scaling)
            elif attend is _grouped_split:  # the split kernel's merge adds the sinks
                out = _grouped_split(q, k, v, gmask, m.scaling, m.sinks)
            else:
                out = _grouped_sinks(q, k, v, gmask, m.scaling, m.sinks)
        if gate is not None:  # gate [1, T, heads * hd], or [1, T, heads, hd] strided (the rope kernel's)
            out = (out.reshape(gate.shape) * torch.sigmoid(gate)).reshape(out.shape)
        projected = _project(m.o, out, None, self.gemv, self.fold_o[i])
        return m.o(out) if projected is None else projected  # [1, T, H]

    def _experts(self, experts, x, index, weights, gate=None) -> torch.Tensor | Parts:
        """Routed experts of rows x [N, H]: the MoE kernels for few rows (their weighted slices, `Parts`), else
        the module (its implementation)."""
        if x.shape[0] <= self.moe_rows and moe.supported(experts) is None:
            return Parts(moe.routed_parts(experts, x, index, weights, gate), None)
        return experts(x, index, weights)

    def _route(self, p: MoEParts, x, logits=None):
        """(top-k weights, expert ids) [N, k] of rows x [N, H]: the declared rule's kernel over the router's
        logits (`logits` [N, E] where already projected) where the MoE kernels run, else the router module."""
        if p.routing is None or not self.moe_rows:
            return p.router(x, *p.router_args)[1:]
        if logits is None:
            logits = _linear(x, p.router.weight, getattr(p.router, "bias", None), self.gemv)  # [N, E]
        return moe.route(logits, p.routing.top_k, p.routing.rule, p.routing.renormalize)

    def _sparse(self, i: int, x):
        """A sparse MoE block over x [1, T, H]: as its module, or as its declared parts (the routed experts of
        a step of at most `moe_rows` rows as `Parts` where `fold_down`)."""
        m, p = self.layers[i], self.layers[i].moe_parts
        if p is None or (x.shape[1] > self.moe_rows and p.routing is None):
            out = m.mlp(x)  # [1, T, H]; some MoE blocks also return their router scores
            return out[0] if isinstance(out, tuple) else out
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        # the shared expert's gate/up (with its gate's logit and the router's logits where fused): one GEMV
        shared_in = self.shared_gate_up[i](flat) if self.shared_gate_up[i] is not None else None
        logits = shared_in[-1] if self.shared_extra[i][1] else None
        weights, index = self._route(p, flat, logits)  # [T, k] each
        out = self._experts(p.experts, flat, index, weights, p.gate)
        fold = isinstance(out, Parts) and self.fold_down[i]
        shared = self._shared(i, flat, shared_in, fold) if p.shared is not None else None
        if fold and not isinstance(
            shared, torch.Tensor
        ):  # summed into the residual by the next norm's kernel
            return out if shared is None else Parts(out.sums, None, shared.sums)
        out = _summed(out, flat)
        return (out if shared is None else out + shared).reshape(x.shape)

    def _shared_folds(self, i: int) -> bool:
        """Whether layer i's shared expert runs as a gated down GEMV's `Parts` in a one-row step: SwiGLU with
        dense names, its gate an output of the fused projection, no down bias."""
        p = self.layers[i].moe_parts
        fused_logit = self.shared_extra[i][0]
        return (
            self.shared_gate_up[i] is not None and fused_logit and self.silu and p.shared_mlp[2].bias is None
        )

    def _shared(self, i: int, x, projected, fold: bool) -> torch.Tensor | Parts:
        """The always-on expert over rows x [N, H], gated per row: sigmoid(shared_gate(x)) * shared(x); for one
        row with `fold`, as `Parts` (the gate applied in the down kernel). `projected`: the outputs of its fused
        gate/up (None: no fused projection)."""
        p = self.layers[i].moe_parts
        if projected is None:
            return torch.sigmoid(p.shared_gate(x)) * p.shared(x)
        gate, up = projected[:2]  # [N, F] each; then the gate's logit [N, 1] where fused
        logit = projected[2] if self.shared_extra[i][0] else p.shared_gate(x)
        down, act = p.shared_mlp[2:]
        # `fold` (the layer's `fold_down`) implies `_shared_folds(i)`; gemv_parts' shape is tuned at run time: not
        # traceable
        if fold and x.shape[0] == 1 and not torch.compiler.is_compiling():
            return Parts(gemv_ops.gemv_parts(up, down.weight, gate, logit), None)
        return torch.sigmoid(logit) * _swiglu_down(self, gate, up, down, act)

    def _branch_route(self, r: moe.ScaledRouting | None, router: nn.Module, x):
        """(top-k weights, expert ids) [N, k] of a parallel branch's rows x [N, H]: its declared router's parts
        through the kernels where the MoE kernels run (a norm, the projection, the routing rule), else the
        module."""
        if r is None or not self.moe_rows:
            return router(x)[1:]
        return self._scaled_route(r, fused_ops.rms_norm(x, r.scale, r.eps, post=r.root))

    def _scaled_route(self, r: moe.ScaledRouting, h):
        """(top-k weights, expert ids) [N, k] from a declared router's input h [N, H] (norm(x) * scale * root);
        one row through the GEMV kernels: the routing kernel adds the GEMV's partial sums itself."""
        if self.gemv and h.shape[0] == 1 and not torch.compiler.is_compiling():
            sums = gemv_ops.gemv_parts(h, r.weight, None)  # [S, 1, E]
            return moe.route(sums, r.top_k, "softmax_topk", True, r.expert_scale, parts=True)
        logits = _linear(h, r.weight, None, self.gemv)  # [N, E]
        return moe.route(logits, r.top_k, "softmax_topk", True, r.expert_scale)

    def _sandwich(self, i: int, x, h):
        """A sandwich layer after its attention output h (`sandwich.runs`): residual x [1, T, H] -> (the layer's
        output, the next layer's input norm of it), in two kernels around the MLP (and a parallel branch)."""
        m = self.layers[i]
        x, normed = sandwich.after_attention(self, i, x, h)
        if self.gate_up[i] is None:
            dense = self._sparse(i, normed[0])
        else:  # a one-row down GEMV's partial sums go to the kernel (`Parts`)
            dense = _swiglu_mlp(self, self.gate_up[i], m.down, m.act, normed[0], fold=True)
        routed = None
        if m.moe_branch is not None:
            rows = (-1, x.shape[-1])
            weights, index = self._scaled_route(m.branch_routing, normed[2].reshape(rows))  # [T, k] each
            routed = self._experts(m.moe_branch[1], normed[1].reshape(rows), index, weights, m.branch_gate)
        return sandwich.after_mlp(self, i, x, dense, routed)

    def _mlp(self, i: int, x):
        m = self.layers[i]
        if self.gate_up[i] is None:
            return self._sparse(i, x)
        return _swiglu_mlp(self, self.gate_up[i], m.down, m.act, x, self.fold_down[i])

    def _ffn(self, i: int, x, h):
        """Residual x [1, T, H] plus the attention output h -> (that sum, the feed-forward sublayer's output for
        it, not yet added)."""
        m = self.layers[i]
        x, normed = self.norm.add(m.post_norm, x, h)
        out = self._mlp(i, normed)
        if m.moe_branch is not None:  # routed experts beside the dense MLP, on the same residual
            router, experts, dense_out, experts_in, experts_out = m.moe_branch
            flat = x.reshape(-1, x.shape[-1])  # [T, H]
            weights, index = self._branch_route(m.branch_routing, router, flat)  # [T, k] each
            routed = _summed(
                self._experts(experts, self.norm(experts_in, flat), index, weights, m.branch_gate), flat
            )
            routed = routed.reshape(x.shape)
            out = self.norm(dense_out, out) + self.norm(experts_out, routed)
        return x, self.norm(m.mlp_out_norm, out) if m.mlp_out_norm is not None else out

    def _masks(self, positions, prefill: bool, dtype) -> dict:
        """Additive group masks by (window, query heads per K/V head), for the layers that need one; ring layers'
        by ("ring", R, window, heads per K/V head), from the positions their slots hold."""
        if prefill and not self.masked_prefill:
            return {}
        keys = self.key_pos[: len(positions)] if prefill else self.key_pos
        masks = {}
        for m, g, ring in zip(self.layers, self.group, self.ring, strict=True):
            if m.q is None:
                continue
            held = self.slot_pos[ring] if ring and not prefill else keys  # [S] the position of each key row
            key = ("ring", ring, m.window, g) if ring and not prefill else (m.window, g)
            if key not in masks:
                ok = held[None, :] <= positions[:, None]  # [T, S] causal
                if m.window is not None:  # HF windows hold the query and the w - 1 keys before it
                    ok = ok & (positions[:, None] - held[None, :] < m.window)
                masks[key] = _group_mask(ok, g, dtype)
        return masks

    def _place(self, positions, prefill: bool) -> None:
        """Record which position each ring slot holds after this forward's writes (prefill: the prompt's last
        R rows; before any mask is built)."""
        for ring, held in self.slot_pos.items():
            if prefill:
                held.fill_(-(2**40))
                positions = positions[-ring:]
            held.index_copy_(0, positions % ring, positions)

    def _rope(self, emb, positions) -> dict:
        """(cos, sin) [T, rot] by layer type (one entry, None, unless the tables differ by type)."""
        ids = (
            positions[None, None].expand(self.axes, 1, -1) if self.axes else positions[None]
        )  # mRoPE: [3, 1, T]
        kinds = {m.kind for m in self.layers if m.q is not None} if self.by_type else {None}
        rope = {}
        for kind in kinds if self.has_attention else ():
            cos, sin = self.rotary_emb(emb, ids, *([kind] if kind else []))  # [1, T, rot] (rot / 2: halves)
            cos, sin = cos[0], sin[0]
            rope[kind] = (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)) if self.halves else (cos, sin)
        return rope

    def forward(self, ids, pos, taps_out=None, prefill: bool = False, last_only: bool = False):
        """ids [1, T] at positions pos.. (0-d long tensor; prefill: pos is 0); fills taps_out [1, T, K*H].

        A forward of T > 1 rows that is not a prefill is a verify: GDN states wait for `commit`.
        """
        emb = self.adapter.embed(ids)  # [1, T, H]
        t = emb.shape[1]
        positions = pos + self.key_pos[:t]  # [T]
        self._place(positions, prefill)
        rope, masks = self._rope(emb, positions), self._masks(positions, prefill, emb.dtype)
        extra = self.adapter.per_layer_inputs(ids, emb) if self.per_layer else None  # [1, T, L, P]
        mode = "prefill" if prefill else "step" if t == 1 else "verify"
        # each sublayer's output is added to the residual x by the next norm's kernel (`_Norms.add`); after a
        # sandwich layer's kernels, `pre` is the next layer's input norm
        x, delta, pre = emb, None, None
        for i, m in enumerate(self.layers):
            x, h = (x, pre) if pre is not None else self.norm.add(m.input_norm, x, delta)
            pre = None
            if self.gdn[i] is not None:
                h = self.gdn[i](h, mode, self.fold_o[i])
            else:
                h = self._attn(i, h, rope[m.kind if self.by_type else None], positions, masks, prefill)
            if self.sandwich[i]:
                x, pre = self._sandwich(i, x, h)
                self._tap(i, x, taps_out)
                continue
            h = self.norm(m.attn_out_norm, h) if m.attn_out_norm is not None else h
            x, delta = self._ffn(i, x, h)
            if i not in self.taps and m.per_layer is None and m.scalar is None:
                continue  # nothing below reads x before the next norm adds delta
            x, delta = x + delta, None  # (never `Parts`: `fold_down` is off here)
            if m.per_layer is not None:  # x += norm(projection(act(gate(x)) * e_i))
                gate, projection, pl_norm, act = m.per_layer
                x = x + self.norm(pl_norm, projection(act(gate(x)) * extra[:, :, i]))
            if m.scalar is not None:
                x = x * m.scalar
            self._tap(i, x, taps_out)
        self._scratch = {}  # the prefill's full-prompt K/V of ring layers: their tails are in the rings now
        if last_only:  # a prefill: the last row's norm only
            x, delta, pre = _plus(x, delta)[:, -1:], None, None
        return self.adapter.logits(pre if pre is not None else self.norm.add(self.final_norm, x, delta)[1])

    def _tap(self, i: int, x, taps_out) -> None:
        """Copy layer i's output x [1, T, H] into its slots of taps_out [1, T, K*H], if it is tapped."""
        for slot in self.taps.get(i, ()) if taps_out is not None else ():
            taps_out[:, :, slot * self.hidden : (slot + 1) * self.hidden].copy_(x)


class StaticDrafter:
    """The drafter over static context K/V buffers; block K/V are scratch rows just past the context."""

    def __init__(
        self,
        drafter: Any,
        max_len: int,
        fuse: bool = True,
        fast_norm: bool = True,
        block_attention: str = "sdpa",
        fused_ops: bool = False,
        gemv: bool = False,
    ):
        self.d, self.fused, self.gemv = drafter, fused_ops, gemv  # as in StaticTarget
        self.silu = drafter.cfg.hidden_act == "silu"  # the kernels' fused SwiGLU
        self.gate_act = gemv_ops.ACTS["silu"] if self.silu else 0
        self.swiglu = fused_ops and self.silu
        self.attend = BLOCK_ATTENTION[block_attention]
        w = drafter.fc.weight
        self.dtype = w.dtype
        a = drafter.layers[0].self_attn
        self.group = a.heads // a.kv_heads
        self.norm = _Norms(drafter.cfg.rms_norm_eps, fast_norm, fused_ops)
        attns = [layer.self_attn for layer in drafter.layers]
        self.qkv = [FusedLinear([a.q_proj, a.k_proj, a.v_proj], fuse, gemv) for a in attns]
        # k/v alone for the context: once q/k/v are fused, k and v lie back to back, so this is a view
        self.kv = [FusedLinear([a.k_proj, a.v_proj], fuse, gemv) for a in attns]
        self.gate_up = [
            FusedLinear([layer.mlp.gate_proj, layer.mlp.up_proj], fuse, gemv) for layer in drafter.layers
        ]
        self.k = [
            torch.zeros(1, a.kv_heads, max_len, a.head_dim, device=w.device, dtype=w.dtype)
            for _ in drafter.layers
        ]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.key_pos = torch.arange(max_len, device=w.device)

    def _qkv(self, i: int, x, positions, rope, with_q: bool):
        """`_qkv_store` for layer i (as `Attention._kv` for k and v): q, or None without `with_q`."""
        a = self.d.layers[i].self_attn
        proj, heads = (self.qkv[i], a.heads) if with_q else (self.kv[i], 0)
        qk, buffers = (a.q_norm, a.k_norm), (self.k[i], self.v[i])
        return _qkv_store(proj, x, heads, self.norm, qk, rope, positions, buffers, self.fused)

    def append(self, feats, pos) -> None:
        """Project context features [1, n, K*H] at positions pos.. into every layer's K/V."""
        n = feats.shape[1]
        positions = pos + self.key_pos[:n]
        feats = feats.to(self.dtype)
        fc = _project(self.d.fc, feats, None, self.gemv, fold=False)
        ctx = self.norm(self.d.hidden_norm, self.d.fc(feats) if fc is None else fc)  # [1, n, H]
        rope = self.d.rotary_emb(positions, self.dtype)
        for i in range(len(self.d.layers)):
            self._qkv(i, ctx, positions, rope, with_q=False)

    def _mask(self, attn, q_pos, pos):
        """[B, S]: context keys below pos, plus the block's own keys (causal / windowed per layer)."""
        kp = self.key_pos[None, :]
        q = q_pos[:, None]
        blk = (kp >= pos) & (kp < pos + len(q_pos))
        if attn.causal:
            blk = blk & (kp <= q)
        ok = ((kp < pos) | blk).expand(len(q_pos), -1)  # [B, S]
        if attn.window is not None:  # HF windows include the current token
            ok = ok & (q - kp < attn.window)
        return ok

    def draft(self, emb, pos):
        """emb [1, B, H] block embeddings at positions pos.. -> [1, B, H] final-norm states."""
        b = emb.shape[1]
        q_pos = pos + self.key_pos[:b]
        rope = self.d.rotary_emb(q_pos, self.dtype)
        masks: dict[tuple, torch.Tensor] = {}  # one group mask per (causal, window) kind, not per layer
        x, delta = emb.to(self.dtype), None  # the residual, and the last sublayer's output not yet added
        for i, layer in enumerate(self.d.layers):
            a, mlp = layer.self_attn, layer.mlp
            kind = (a.causal, a.window)
            if kind not in masks:
                masks[kind] = _group_mask(self._mask(a, q_pos, pos), self.group, self.dtype)
            x, h = self.norm.add(layer.input_layernorm, x, delta)
            q = self._qkv(i, h, q_pos, rope, with_q=True)  # [1, heads, B, hd]; K/V rows: scratch for append
            out = self.attend(q, self.k[i], self.v[i], masks[kind], a.head_dim**-0.5)
            o = _project(a.o_proj, out, None, self.gemv, fold=False)  # block rows: never `Parts`
            x, h = self.norm.add(layer.post_attention_layernorm, x, a.o_proj(out) if o is None else o)
            delta = _swiglu_mlp(self, self.gate_up[i], mlp.down_proj, mlp.act, h)  # block rows: never `Parts`
        return self.norm.add(self.d.norm, x, delta)[1]
