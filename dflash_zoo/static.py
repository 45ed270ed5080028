"""Static-shape forwards for the fast path: the target and the drafter over pre-allocated K/V buffers.

- `StaticTarget`: an own forward over a dense full-attention target's HF modules (norms, q/k/v/o projections,
  MLP, rotary embedding; transformers `models/qwen3`, `models/llama`) writing K/V at tensor positions into
  [1, kvh, S, hd] buffers. Rollback is a position counter: rejected rows stay, masked, until overwritten.
- `StaticDrafter`: the DFlash drafter (drafter.py modules) over a static context K/V buffer; the block's own
  K/V are written as scratch rows just past the context, so nothing is concatenated per step.
Every shape is fixed for a given block, so a step can be captured in a CUDA graph (fast.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .results import GenerationConfig
from .rope import apply_rotary


def unsupported_reason(adapter: Any, cfg: GenerationConfig | None = None) -> str | None:
    """Why the fast path cannot run this pair (None: it can)."""
    text = adapter.text_config
    if adapter.static_qk_norm is None:
        return f"model_type {text.model_type!r} has no static path (its adapter does not declare one)"
    if any(t != "full_attention" for t in (getattr(text, "layer_types", None) or [])):
        return "target has non-full-attention layers"
    if cfg is not None and not cfg.greedy:
        return "the fast path is greedy only"
    return None


def _grouped_sdpa(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [1, h, T, d]; k, v [1, kvh, S, d]; mask [T, S] bool -> [1, T, h*d].

    GQA as extra query rows ([1, kvh, g*T, d]) so the masked kernel needs no repeated K/V.
    """
    _, h, t, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qg = q.reshape(1, kvh, g * t, d)  # head h = kv_head * g + i, rows ordered (i, t)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask.repeat(g, 1)[None, None], scale=scale)
    return out.reshape(1, h, t, d).transpose(1, 2).reshape(1, t, h * d)


class StaticTarget:
    """The target's decoder over static K/V buffers [1, kvh, max_len, hd] per layer."""

    def __init__(self, adapter: Any, max_len: int, tap_ids: tuple[int, ...]):
        self.adapter, self.model = adapter, adapter.model
        self.layers, self.decoder = adapter.layers(), adapter.model.get_decoder()
        text = adapter.text_config
        self.qk_norm = adapter.static_qk_norm
        self.kvh, self.hd = text.num_key_value_heads, self.layers[0].self_attn.head_dim
        self.taps: dict[int, list[int]] = {}  # layer id -> tap slots (ids may repeat)
        for slot, lid in enumerate(tap_ids):
            self.taps.setdefault(lid, []).append(slot)
        self.hidden = text.hidden_size
        self.k, self.v = [], []
        for layer in self.layers:
            w = layer.self_attn.k_proj.weight
            self.k.append(torch.zeros(1, self.kvh, max_len, self.hd, device=w.device, dtype=w.dtype))
            self.v.append(torch.zeros_like(self.k[-1]))
        dev = self.k[0].device
        self.key_pos = torch.arange(max_len, device=dev)  # [S]

    def _attn(self, i: int, x, cos, sin, positions, mask, prefill: bool):
        attn = self.layers[i].self_attn
        t = x.shape[1]
        q = attn.q_proj(x).view(1, t, -1, self.hd)
        k = attn.k_proj(x).view(1, t, -1, self.hd)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(1, t, -1, self.hd).transpose(1, 2)  # [1, kvh, T, hd]
        self.k[i].index_copy_(2, positions, k)
        self.v[i].index_copy_(2, positions, v)
        if prefill:  # from position 0: causal flash kernel over the prompt, no mask tensor
            g = q.shape[1] // self.kvh  # K/V heads repeated for the kernel (transient, one layer at a time)
            kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=attn.scaling).transpose(
                1, 2
            )
            return attn.o_proj(out.reshape(1, t, -1))
        return attn.o_proj(_grouped_sdpa(q, self.k[i], self.v[i], mask, attn.scaling))

    def forward(self, emb, pos, taps_out=None, prefill: bool = False, last_only: bool = False):
        """emb [1, T, H] at positions pos.. (0-d long tensor; prefill: pos is 0); fills taps_out [1, T, K*H]."""
        t = emb.shape[1]
        positions = pos + self.key_pos[:t]  # [T]
        cos, sin = self.decoder.rotary_emb(emb, positions[None])  # [1, T, hd]
        cos, sin = cos[0], sin[0]
        mask = None if prefill else self.key_pos[None, :] <= positions[:, None]  # [T, S] causal
        x = emb
        for i, layer in enumerate(self.layers):
            x = x + self._attn(i, layer.input_layernorm(x), cos, sin, positions, mask, prefill)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            for slot in self.taps.get(i, ()) if taps_out is not None else ():
                taps_out[:, :, slot * self.hidden : (slot + 1) * self.hidden].copy_(x)
        x = x[:, -1:] if last_only else x
        return self.adapter.logits(self.decoder.norm(x))  # [1, T or 1, V]


class StaticDrafter:
    """The drafter over static context K/V buffers; block K/V are scratch rows just past the context."""

    def __init__(self, drafter: Any, max_len: int):
        self.d = drafter
        w = drafter.fc.weight
        self.dtype = w.dtype
        a = drafter.layers[0].self_attn
        self.k = [
            torch.zeros(1, a.kv_heads, max_len, a.head_dim, device=w.device, dtype=w.dtype)
            for _ in drafter.layers
        ]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.key_pos = torch.arange(max_len, device=w.device)

    def append(self, feats, pos) -> None:
        """Project context features [1, n, K*H] at positions pos.. into every layer's K/V."""
        n = feats.shape[1]
        positions = pos + self.key_pos[:n]
        ctx = self.d.hidden_norm(self.d.fc(feats.to(self.dtype)))  # [1, n, H]
        rope = self.d.rotary_emb(positions, self.dtype)
        for i, layer in enumerate(self.d.layers):
            k, v = layer.self_attn._kv(ctx, *rope)  # [1, kvh, n, hd]
            self.k[i].index_copy_(2, positions, k)
            self.v[i].index_copy_(2, positions, v)

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
        x = emb.to(self.dtype)
        for i, layer in enumerate(self.d.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_norm(a.q_proj(h).view(1, b, a.heads, a.head_dim)).transpose(1, 2)
            k, v = a._kv(h, *rope)
            self.k[i].index_copy_(2, q_pos, k)  # scratch: the next append overwrites these rows
            self.v[i].index_copy_(2, q_pos, v)
            out = _grouped_sdpa(
                apply_rotary(q, *rope), self.k[i], self.v[i], self._mask(a, q_pos, pos), a.head_dim**-0.5
            )
            x = x + a.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.d.norm(x)
