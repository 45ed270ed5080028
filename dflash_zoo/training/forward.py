"""The drafter's training forward with a pluggable attention kernel (`attention.Attend`).

`TrainingDrafter` wraps a `DFlashDrafter` so that DDP sees one module whose forward is the training pass.
With `dense` attention it calls the drafter itself (the engine's forward, the reference). With `flex` it runs
the same computation layer by layer over the drafter's own modules, with only the attention call replaced:
`tests/test_train_flex.py` checks that this pass with the dense kernel equals the drafter's forward exactly,
so a change to the engine's layer that is not mirrored here fails a test instead of training another model.
Training calls carry no cache: every context position is new.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_zoo.engine.drafter import DFlashDrafter, Span
from dflash_zoo.engine.rope import apply_rotary
from dflash_zoo.errors import InvalidArgumentError
from dflash_zoo.training.attention import Attend


def _layer(layer: nn.Module, x, ctx, rope_q, rope_ctx, attend: Attend) -> torch.Tensor:
    """One decoder layer (engine `DecoderLayer` + `Attention`), attention through `attend`."""
    a = layer.self_attn
    b, n, _ = x.shape
    h = layer.input_layernorm(x)
    q = a.q_norm(a.q_proj(h).view(b, n, a.heads, a.head_dim)).transpose(1, 2)
    q = apply_rotary(q, *rope_q)  # [B, heads, N, hd]
    k_blk, v_blk = a._kv(h, *rope_q)  # [B, kvh, N, hd]
    k_ctx, v_ctx = a._kv(ctx, *rope_ctx)  # [B, kvh, C, hd]
    out = attend(q, k_ctx, v_ctx, k_blk, v_blk, a.causal, a.window)  # [B, heads, N, hd]
    x = x + a.o_proj(out.transpose(1, 2).reshape(b, n, a.heads * a.head_dim))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def draft_forward(
    drafter: DFlashDrafter, emb: torch.Tensor, feats: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """emb [B, N, H] block embeddings, feats [B, C, K*H] -> [B, N, H] final-norm states (no cache)."""
    span = attend.span
    ctx = drafter.hidden_norm(drafter.fc(feats))  # [B, C, H]
    dtype = emb.dtype
    rope_q = drafter.rotary_emb(span.q_pos, dtype)  # [N, rot] or [B, N, rot]
    if span.q_pos.dim() == 2:  # per-row positions: broadcast over heads
        rope_q = tuple(t.unsqueeze(1) for t in rope_q)
    rope_ctx = drafter.rotary_emb(span.ctx_pos, dtype)
    x = emb
    for layer in drafter.layers:
        x = _layer(layer, x, ctx, rope_q, rope_ctx, attend)
    return drafter.norm(x)


class TrainingDrafter(nn.Module):
    """The module the trainer optimises (and DDP wraps): `forward(emb, feats, span)` -> final-norm states."""

    def __init__(self, drafter: DFlashDrafter, attention: str):
        super().__init__()
        if attention == "flex" and drafter.arch != "dflash":
            raise InvalidArgumentError(
                f"flex attention is written for the dflash drafter layer, not {drafter.arch!r}",
                hint="use --attention dense",
            )
        self.drafter, self.attention = drafter, attention

    def forward(self, emb: torch.Tensor, feats: torch.Tensor, span: Span) -> torch.Tensor:
        if self.attention == "dense":
            return self.drafter(emb, feats, span)
        return draft_forward(self.drafter, emb, feats, Attend(span, emb.shape[0], self.attention))


def bare_drafter(module: nn.Module) -> DFlashDrafter:
    """The drafter inside a DDP and/or `TrainingDrafter` wrapper (or `module` itself)."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        module = module.module
    return module.drafter if isinstance(module, TrainingDrafter) else module


def block_embeddings(drafter: DFlashDrafter, adapter: Any, block: torch.Tensor) -> torch.Tensor:
    """[R, N] block ids -> [R, N, H], as the engine embeds a block for this drafter."""
    with torch.no_grad():
        return drafter.embed_block(block, adapter)


def logits_fn(drafter: DFlashDrafter, adapter: Any):
    """h [M, H] -> [M, V] drafter logits as the engine computes them (the target's LM head in its dtype,
    then the drafter's own multiplier / soft-cap)."""
    dtype = adapter.model.get_output_embeddings().weight.dtype
    return lambda h: drafter.draft_logits(h.to(dtype), adapter.head)
