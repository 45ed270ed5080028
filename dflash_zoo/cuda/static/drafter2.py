"""The DFlash 2 drafter in the static engine: `StaticDrafter` plus the convolutions around every sublayer and the
candidate selector, with the kernels of cuda/ops/dflash2.py where the Triton kernels run.

Per layer a draft adds two `kernel_projection` GEMMs (one per sublayer: both convolutions' coefficients come
from the sublayer's input) and four block convolutions; the selector's whole walk is one program. Off the
kernels (CPU without the interpreter, or kernels turned off) the drafter's own torch modules run the same steps.
Every shape is fixed, so a draft and its proposals are captured in the step's CUDA graph.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_zoo.cuda.ops.attention import group_mask
from dflash_zoo.cuda.static.drafter import StaticDrafter
from dflash_zoo.cuda.static.kernel_choice import Kernels
from dflash_zoo.cuda.static.linear import project
from dflash_zoo.cuda.static.mlp import swiglu_mlp
from dflash_zoo.drafters.dflash2 import GroupedDynamicConv, race_for
from dflash_zoo.engine.options import FastOptions


class StaticDFlash2Drafter(StaticDrafter):
    """`StaticDrafter` for a `DFlash2Drafter`: convolutions inside `draft`, the selector in `propose`."""

    def __init__(self, drafter: Any, max_len: int, options: FastOptions, kernels: Kernels):
        super().__init__(drafter, max_len, options, kernels)
        self.kernels = kernels.fused_ops  # the block convolution and the selector walk as kernels

    def _conv(
        self, conv: GroupedDynamicConv, side: int, x: torch.Tensor, coeff: torch.Tensor
    ) -> torch.Tensor:
        """x [1, B, H] one sublayer's input (side 0) or output (side 1); coeff [B, 2, K, G] from its input."""
        if self.kernels:
            from dflash_zoo.cuda.ops.dflash2 import block_conv

            return block_conv(x[0], coeff[:, side], conv.base_kernel[side])[None]
        return conv.convolve(x, coeff[None, :, side], conv.base_kernel[side], None)

    def _coeff(self, conv: GroupedDynamicConv, h: torch.Tensor) -> torch.Tensor:
        """h [1, B, H] -> both sides' coefficients [B, 2, K, G] (one GEMM)."""
        c = project(conv.kernel_projection, h, None, self.gemv, fold=False)
        c = conv.kernel_projection(h) if c is None else c
        return c.view(h.shape[1], 2, conv.kernel, conv.groups)

    def draft(self, emb, pos):
        """emb [1, B, H] block embeddings at positions pos.. -> [1, B, H] final-norm states."""
        b = emb.shape[1]
        q_pos = pos + self.key_pos[:b]
        rope = self.d.rotary_emb(q_pos, self.dtype)
        masks: dict[tuple, torch.Tensor] = {}
        x, delta = emb.to(self.dtype), None  # the residual, and the last sublayer's output not yet added
        for i, layer in enumerate(self.d.layers):
            a, mlp, ac, mc = layer.self_attn, layer.mlp, layer.attention_conv, layer.mlp_conv
            kind = (a.causal, a.window)
            if kind not in masks:
                masks[kind] = group_mask(self._mask(a, q_pos, pos), self.group, self.dtype)
            x, h = self.norm.add(layer.input_layernorm, x, delta)
            coeff = self._coeff(ac, h)
            h = self._conv(ac, 0, h, coeff)
            q = self._qkv(i, h, q_pos, rope, with_q=True)  # [1, heads, B, hd]
            out = self.attend(q, self.k[i], self.v[i], masks[kind], a.head_dim**-0.5)
            o = project(a.o_proj, out, None, self.gemv, fold=False)
            x, h = self.norm.add(
                layer.post_attention_layernorm, x, self._conv(ac, 1, a.o_proj(out) if o is None else o, coeff)
            )
            coeff = self._coeff(mc, h)
            h = self._conv(mc, 0, h, coeff)
            delta = self._conv(mc, 1, swiglu_mlp(self.mlp, self.gate_up[i], mlp.down_proj, mlp.act, h), coeff)
        return self.norm.add(self.d.norm, x, delta)[1]

    def propose(self, h, anchor, head, sampler, gen):
        """The selector's walk over slots h [n, H] (one kernel when the kernels run): as `DFlash2Drafter.propose`."""
        if not (self.kernels and self.d.use_selector):
            return self.d.propose(h, anchor, head, sampler, gen)
        from dflash_zoo.cuda.ops.dflash2 import selector_walk

        sel = self.d.candidate_selector
        logits = self.d.draft_logits(h, head)  # [n, V]
        unary, cands, _, proj = sel.candidates(h, logits)
        race = race_for(cands, sampler.temperature, gen)
        pred, succ = sel.predecessor_codebook, sel.successor_codebook
        drafts, q_k = selector_walk(unary, cands, proj, pred, succ, anchor, race, sampler.temperature)
        if sampler.greedy:
            return drafts, None
        q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # [n, V]
        return drafts, q.scatter_(-1, cands, q_k)
