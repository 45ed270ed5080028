"""The static engine's target: an own forward over the target's HF modules (norms, q/k/v/o projections, MLPs,
rotary embedding), found through the names its adapter declares (`static_layout`, resolved in layout.py).

Attention layers write K/V at tensor positions into static buffers (kv.py; the attention itself:
cuda/ops/attention.py). Rollback is a position counter: rejected rows stay, masked, until overwritten;
Gated-DeltaNet layers keep static states that a commit moves on (gdn.py). A sparse MoE block runs as its
declared parts (moe.py); a sandwich-norm layer's residual adds run as one kernel each (sandwich.py). Every shape
is fixed for a given block, so a step can be captured in a CUDA graph (fast.py).

Fewer kernels per layer (each costs ~2.5 us inside a graph on an H200, docs/performance.md), as `FastOptions`
and the resolved `Kernels` say: fused q/k/v and gate/up GEMMs (linear.py), `F.rms_norm` (norms.py), split-KV
attention, few-row projections through the GEMV, and the elementwise work between GEMMs through the fused
kernels, each residual add inside the next norm's kernel (which also sums a one-row o / down GEMV's partial
sums). FP8 projections (an FP8 target's, fp8.py) run through the FP8 kernels, in the same places.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dflash_zoo.cuda.ops import fp8 as fp8_ops
from dflash_zoo.cuda.ops.attention import BLOCK_ATTENTION, DECODE_ATTENTION, grouped_sinks, grouped_split
from dflash_zoo.cuda.ops.gemv import ACTS
from dflash_zoo.cuda.static import sandwich
from dflash_zoo.cuda.static.gdn import StaticGDN
from dflash_zoo.cuda.static.kernel_choice import Kernels
from dflash_zoo.cuda.static.kv import KVBuffers
from dflash_zoo.cuda.static.layout import TargetModules, resolve
from dflash_zoo.cuda.static.linear import FusedLinear, plus, project, summed
from dflash_zoo.cuda.static.mlp import MLPKernels, swiglu_mlp
from dflash_zoo.cuda.static.moe import MoEBlocks
from dflash_zoo.cuda.static.norms import Norms
from dflash_zoo.cuda.static.qkv import QKVOptions, qkv_store, rope_kernel
from dflash_zoo.engine.options import FastOptions
from dflash_zoo.errors import UnsupportedModelError
from dflash_zoo.quantization import fp8_modules_reason

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import TargetAdapter


class StaticTarget:
    """The target's decoder over static K/V buffers [1, kvh, max_len, hd] per attention layer, and static
    conv / recurrent states per Gated-DeltaNet layer (gdn.py).

    Attention layers are full or sliding-window (a mask), optionally with sinks, biases, an output gate,
    value norms, values taken from the keys, K/V shared with an earlier layer, partial rotary and their own head
    size, as the adapter's layout declares; GDN layers keep their states until `commit`. Decoder layers are
    pre-norm residual blocks, optionally with sandwich norms, a parallel MoE branch, a per-layer input and an
    output scalar (Gemma).

    Args: the adapter; the buffers' length; the layers whose outputs the drafter taps; the options and the
    kernels resolved for the device (`kernel_choice.py`); the most rows a step has (the verify block).
    """

    def __init__(
        self, adapter: TargetAdapter, max_len: int, tap_ids: tuple[int, ...], options: FastOptions,
        kernels: Kernels, max_rows: int = 16,
    ):  # fmt: skip
        self.adapter, self.model = adapter, adapter.model
        mods = resolve(adapter)  # every module through the adapter's `static_layout`
        self.layers, self.final_norm, self.rotary_emb = mods.layers, mods.final_norm, mods.rotary_emb
        self.hidden, self.heads = adapter.text_config.hidden_size, adapter.text_config.num_attention_heads
        self.dtype = mods.final_norm.weight.dtype
        self._fp8(mods, kernels)
        self._choose(mods, options, kernels)
        self.taps: dict[int, list[int]] = {}  # layer id -> tap slots (ids may repeat)
        for slot, lid in enumerate(tap_ids):
            self.taps.setdefault(lid, []).append(slot)
        self._projections(mods, options, kernels)
        # sandwich-norm layers: each residual add, with its norms, in one kernel (sandwich.py)
        self.sandwich = [sandwich.runs(self, i) for i in range(len(self.layers))]
        self.fold_o, self.fold_down = self._folds(mods.final_norm)
        # an FP8 target's K/V in its activations' dtype (None: its k projections' weights')
        device, kv_dtype = mods.final_norm.weight.device, self.dtype if self.fp8_weights else None
        self.kv = KVBuffers(self.layers, self.heads, max_len, max_rows, device, kv_dtype)
        self._scratch: dict[int, tuple] = {}  # prefill only: full-prompt K/V of ring layers
        self.has_attention = any(q is not None for q in self.qkv)  # else no rotary tables to compute
        self.per_layer = any(m.per_layer is not None for m in self.layers)  # per-layer inputs from the ids

    def _fp8(self, mods: TargetModules, kernels: Kernels) -> None:
        """Refuse FP8 weights the engine does not read (engine selection's reason), or FP8 kernels (the mode
        `kernels.fp8`) where they cannot run."""
        why = fp8_modules_reason(self.adapter)
        self.fp8_weights = any(p.dtype == fp8_ops.FP8 for p in self.model.parameters())
        if why is None and self.fp8_weights and kernels.fp8 != "torch":
            why = fp8_ops.device_reason(mods.final_norm.weight.device)
        if why is not None:
            hint = "fast=False runs it on the eager engine"
            raise UnsupportedModelError(f"the target is FP8-quantized: {why}", hint=hint)

    def _choose(self, mods: TargetModules, options: FastOptions, kernels: Kernels) -> None:
        """The rotary layout, the attention functions, the norms and the MLPs' kernels."""
        layout = mods.layout
        self.halves, self.axes, self.by_type = (
            layout.rotary_halves,
            layout.rotary_axes,
            layout.rotary_by_layer_type,
        )
        self.decode_attend = DECODE_ATTENTION[kernels.decode_attention]  # T = 1 steps only
        self.block_attend = BLOCK_ATTENTION[kernels.block_attention]  # verify steps (T > 1)
        self.gemv = kernels.projections(options)  # few-row projections through the GEMV kernels
        # steps of at most this many rows run routed experts through the kernels
        self.moe_rows = kernels.moe_rows
        # the declared RMSNorm formula (the norm kernel computes each); `F.rms_norm` for Llama's only
        llama = layout.norms == "llama"
        self.norm = Norms(mods.eps, options.fast_norm and llama, kernels.fused_ops, layout.norms)
        # the dense MLPs' activation in the GEMV (0: none); silu(gate) * up in one kernel
        gate_act = ACTS.get(mods.activation, 0)
        self.mlp = MLPKernels(gate_act, self.gemv, kernels.fused_ops and mods.activation == "silu")

    def _projections(self, mods: TargetModules, options: FastOptions, kernels: Kernels) -> None:
        """Fused q/k/v and gate/up projections, the rope kernel's layers, the GDN layers and the MoE blocks."""
        fuse, gemv, layers = options.fuse, self.gemv, self.layers
        # q/k/v as one GEMM; a KV-shared layer projects q alone, one whose values are its keys q and k
        self.qkv = [FusedLinear([p for p in (m.q, m.k, m.v) if p is not None], fuse, gemv) if m.q is not None
                    else None for m in layers]  # fmt: skip
        self.opts = [QKVOptions(m.output_gate, m.qk_norm_per_head, m.v_norm, m.kv_source is not None)
                     for m in layers]  # fmt: skip
        # q/k norm + rotary + K/V writes in one kernel where `rope_kernel` accepts the layer
        self.rope_kernel = [
            kernels.fused_ops and rope_kernel(m, o, mods.eps) for m, o in zip(layers, self.opts, strict=True)
        ]
        # GDN layers: their own static states; the input projections as one GEMM, split by the adapter
        gdn = (self.adapter.gdn_split, kernels.fused_ops, fuse, gemv, options.gdn_verify, options.fla)
        self.gdn = [StaticGDN(m.gdn, m.gdn_parts, *gdn) if m.gdn is not None else None for m in layers]
        # dense MLPs only: a sparse MoE block runs as its module or its declared parts (`MoEBlocks`): None here
        self.gate_up = [
            FusedLinear([m.gate, m.up], fuse, gemv) if m.gate is not None else None for m in layers
        ]
        self.moe = MoEBlocks(layers, fuse, gemv, self.mlp, self.moe_rows)

    def _folds(self, final_norm) -> tuple[list[bool], list[bool]]:
        """(fold_o, fold_down) per layer: few-row o / down projections whose partial sums the next residual add
        takes (`Parts`), where that add and norm run as one kernel and nothing else reads the sublayer's output
        first."""
        if not self.gemv.on:
            return [False] * len(self.layers), [False] * len(self.layers)
        fuses = [
            self.norm.fuses(n, self.dtype) for n in (*(m.input_norm for m in self.layers[1:]), final_norm)
        ]
        # an attention or GDN layer's output projection, summed by the next norm's kernel or the sandwich kernel
        o = [(q is not None or m.gdn is not None)
             and (m.attn_out_norm is None and self.norm.fuses(m.post_norm, self.dtype) or sandwich_layer)
             for q, m, sandwich_layer in zip(self.qkv, self.layers, self.sandwich, strict=True)]  # fmt: skip
        # a dense SwiGLU MLP's down GEMV, or a sparse block's routed experts and its shared expert, if any, where
        # that folds too (`MoEBlocks.sparse`)
        sparse = [m.moe_parts is not None and (m.moe_parts.shared is None or self.moe.shared_folds(i))
                  for i, m in enumerate(self.layers)]  # fmt: skip
        parts = [
            (g is not None and self.mlp.gate_act) or f for g, f in zip(self.gate_up, sparse, strict=True)
        ]
        down = [  # the layer's residual sum is left to the next norm (`forward`), which fuses
            p and nxt and m.moe_branch is None and m.mlp_out_norm is None
            and i not in self.taps and m.per_layer is None and m.scalar is None
            for i, (p, m, nxt) in enumerate(zip(parts, self.layers, fuses, strict=True))
        ]  # fmt: skip
        return o, down

    def states(self) -> list[torch.Tensor]:
        """Tensors a step mutates in place besides K/V rows it rewrites itself (GDN states, ring slots)."""
        return [t for g in self.gdn if g is not None for t in g.states()] + self.kv.states()

    def commit(self, n: torch.Tensor) -> None:
        """After a verify: the first `n` rows (0-d long tensor) were committed; GDN states move past them
        (attention needs nothing: rejected K/V rows stay masked until overwritten)."""
        for g in self.gdn:
            if g is not None:
                g.commit(n)

    def _attn(self, i: int, x, rope, positions, masks, prefill: bool):
        """Attention layer i over its K/V buffers: x [1, T, H] normed -> its output projection [1, T, H] (`Parts`
        where `fold_o`); K/V rows written at `positions` (prefill: the prompt's, from position 0)."""
        kv, m, t = self.kv, self.layers[i], x.shape[1]
        g, ring = kv.group[i], kv.ring[i]
        buffers, rows, key = (kv.k[i], kv.v[i]), positions, (m.window, g)
        if ring and prefill:  # the whole prompt's K/V (a prompt can be longer than the ring), then its tail
            src = i if m.kv_source is None else m.kv_source
            if src not in self._scratch:
                self._scratch[src] = tuple(b.new_zeros(*b.shape[:2], t, b.shape[-1]) for b in buffers)
            buffers = self._scratch[src]
        elif ring:
            rows, key = positions % ring, ("ring", ring, m.window, g)
        q = qkv_store(self.qkv[i], x, self.heads, self.norm, m.qk_norm, rope, rows, buffers,
                      self.rope_kernel[i], self.opts[i])  # fmt: skip
        if ring and prefill and m.kv_source is None:
            kept = positions[-ring:]  # the last R prompt rows into their slots
            for ring_buf, full in zip((kv.k[i], kv.v[i]), buffers, strict=True):
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
            elif attend is grouped_split:  # the split kernel's merge adds the sinks
                out = grouped_split(q, k, v, gmask, m.scaling, m.sinks)
            else:
                out = grouped_sinks(q, k, v, gmask, m.scaling, m.sinks)
        if gate is not None:  # gate [1, T, heads * hd], or [1, T, heads, hd] strided (the rope kernel's)
            out = (out.reshape(gate.shape) * torch.sigmoid(gate)).reshape(out.shape)
        projected = project(m.o, out, None, self.gemv, self.fold_o[i])
        return m.o(out) if projected is None else projected  # [1, T, H]

    def _sandwich(self, i: int, x, h):
        """A sandwich layer after its attention output h (`sandwich.runs`): residual x [1, T, H] -> (the layer's
        output, the next layer's input norm of it), in two kernels around the MLP (and a parallel branch)."""
        m = self.layers[i]
        x, normed = sandwich.after_attention(self, i, x, h)
        if self.gate_up[i] is None:
            dense = self.moe.sparse(i, normed[0], self.fold_down[i])
        else:  # a one-row down GEMV's partial sums go to the kernel (`Parts`)
            dense = swiglu_mlp(self.mlp, self.gate_up[i], m.down, m.act, normed[0], fold=True)
        routed = None
        if m.moe_branch is not None:
            rows = (-1, x.shape[-1])
            weights, index = self.moe.scaled_route(m.branch_routing, normed[2].reshape(rows))  # [T, k] each
            routed = self.moe.experts(m.moe_branch[1], normed[1].reshape(rows), index, weights, m.branch_gate)
        return sandwich.after_mlp(self, i, x, dense, routed)

    def _mlp(self, i: int, x):
        """Layer i's dense MLP or sparse MoE block over x [1, T, H] (`Parts` where `fold_down`)."""
        m = self.layers[i]
        if self.gate_up[i] is None:
            return self.moe.sparse(i, x, self.fold_down[i])
        return swiglu_mlp(self.mlp, self.gate_up[i], m.down, m.act, x, self.fold_down[i])

    def _ffn(self, i: int, x, h):
        """Residual x [1, T, H] plus the attention output h -> (that sum, the feed-forward sublayer's output for
        it, not yet added)."""
        m = self.layers[i]
        x, normed = self.norm.add(m.post_norm, x, h)
        out = self._mlp(i, normed)
        if m.moe_branch is not None:  # routed experts beside the dense MLP, on the same residual
            router, experts, dense_out, experts_in, experts_out = m.moe_branch
            flat = x.reshape(-1, x.shape[-1])  # [T, H]
            weights, index = self.moe.branch_route(m.branch_routing, router, flat)  # [T, k] each
            routed = summed(
                self.moe.experts(experts, self.norm(experts_in, flat), index, weights, m.branch_gate), flat
            )
            routed = routed.reshape(x.shape)
            out = self.norm(dense_out, out) + self.norm(experts_out, routed)
        return x, self.norm(m.mlp_out_norm, out) if m.mlp_out_norm is not None else out

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
        positions = pos + self.kv.key_pos[:t]  # [T]
        self.kv.place(positions, prefill)
        rope, masks = self._rope(emb, positions), self.kv.masks(self.layers, positions, prefill, emb.dtype)
        extra = self.adapter.per_layer_inputs(ids, emb) if self.per_layer else None  # [1, T, L, P]
        mode = "prefill" if prefill else "step" if t == 1 else "verify"
        # each sublayer's output is added to the residual x by the next norm's kernel (`Norms.add`); after a
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
            x, delta, pre = plus(x, delta)[:, -1:], None, None
        return self.adapter.logits(pre if pre is not None else self.norm.add(self.final_norm, x, delta)[1])

    def _tap(self, i: int, x, taps_out) -> None:
        """Copy layer i's output x [1, T, H] into its slots of taps_out [1, T, K*H], if it is tapped."""
        for slot in self.taps.get(i, ()) if taps_out is not None else ():
            taps_out[:, :, slot * self.hidden : (slot + 1) * self.hidden].copy_(x)
