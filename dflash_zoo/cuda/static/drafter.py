"""The DFlash drafter in the static engine: its layers over a static context K/V buffer per layer.

Context features are projected into every layer's K/V once, at their positions (`append`); a draft writes the
block's own K/V as scratch rows just past the context, so nothing is concatenated per step, and the next append
overwrites them. Every shape is fixed for a given block, so a draft can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_zoo.cuda.ops.attention import BLOCK_ATTENTION, group_mask
from dflash_zoo.cuda.ops.gemv import ACTS
from dflash_zoo.cuda.static.kernel_choice import Kernels
from dflash_zoo.cuda.static.linear import FusedLinear, project
from dflash_zoo.cuda.static.mlp import MLPKernels, swiglu_mlp
from dflash_zoo.cuda.static.norms import Norms
from dflash_zoo.cuda.static.qkv import qkv_store
from dflash_zoo.engine.options import FastOptions


class StaticDrafter:
    """The drafter over static context K/V buffers; block K/V are scratch rows just past the context.

    Args: the drafter, the buffers' length, the options and the kernels resolved for the device.
    """

    def __init__(self, drafter: Any, max_len: int, options: FastOptions, kernels: Kernels):
        self.d, self.kernel = drafter, kernels.fused_ops  # the fused kernels, as in StaticTarget
        self.gemv = gemv = kernels.projections(options)
        silu = drafter.cfg.hidden_act in ("silu", "swish")  # the kernels' fused SwiGLU
        self.mlp = MLPKernels(ACTS["silu"] if silu else 0, gemv, kernels.fused_ops and silu)
        self.attend = BLOCK_ATTENTION[kernels.block_attention]
        w = drafter.fc.weight
        self.dtype = w.dtype
        a = drafter.layers[0].self_attn
        self.group = a.heads // a.kv_heads
        self.norm = Norms(drafter.cfg.rms_norm_eps, options.fast_norm, kernels.fused_ops)
        attns, fuse = [layer.self_attn for layer in drafter.layers], options.fuse
        self.qkv = [FusedLinear([a.q_proj, a.k_proj, a.v_proj], fuse, gemv) for a in attns]
        # k/v alone for the context: once q/k/v are fused, k and v lie back to back, so this is a view
        self.kv = [FusedLinear([a.k_proj, a.v_proj], fuse, gemv) for a in attns]
        self.gate_up = [FusedLinear([ly.mlp.gate_proj, ly.mlp.up_proj], fuse, gemv) for ly in drafter.layers]
        self.k = [
            torch.zeros(1, a.kv_heads, max_len, a.head_dim, device=w.device, dtype=w.dtype)
            for _ in drafter.layers
        ]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.key_pos = torch.arange(max_len, device=w.device)

    def propose(self, h, anchor, head, sampler, gen):
        """Slots h [n, H] -> (drafts [n], q [n, V] or None): the drafter's own proposal rule."""
        return self.d.propose(h, anchor, head, sampler, gen)

    def _qkv(self, i: int, x, positions, rope, with_q: bool):
        """`qkv_store` for layer i (as `Attention._kv` for k and v): q, or None without `with_q`."""
        a = self.d.layers[i].self_attn
        proj, heads = (self.qkv[i], a.heads) if with_q else (self.kv[i], 0)
        qk, buffers = (a.q_norm, a.k_norm), (self.k[i], self.v[i])
        return qkv_store(proj, x, heads, self.norm, qk, rope, positions, buffers, self.kernel)

    def append(self, feats, pos) -> None:
        """Project context features [1, n, K*H] at positions pos.. into every layer's K/V."""
        n = feats.shape[1]
        positions = pos + self.key_pos[:n]
        feats = feats.to(self.dtype)
        fc = project(self.d.fc, feats, None, self.gemv, fold=False)
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
            if not attn.causal:  # a bidirectional window reaches as far ahead (engine/drafter.py `Span.mask`)
                ok = ok & (kp - q < attn.window)
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
                masks[kind] = group_mask(self._mask(a, q_pos, pos), self.group, self.dtype)
            x, h = self.norm.add(layer.input_layernorm, x, delta)
            q = self._qkv(i, h, q_pos, rope, with_q=True)  # [1, heads, B, hd]; K/V rows: scratch for append
            out = self.attend(q, self.k[i], self.v[i], masks[kind], a.head_dim**-0.5)
            o = project(a.o_proj, out, None, self.gemv, fold=False)  # block rows: never `Parts`
            x, h = self.norm.add(layer.post_attention_layernorm, x, a.o_proj(out) if o is None else o)
            delta = swiglu_mlp(
                self.mlp, self.gate_up[i], mlp.down_proj, mlp.act, h
            )  # block rows: never `Parts`
        return self.norm.add(self.d.norm, x, delta)[1]
