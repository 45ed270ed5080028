"""The native DFlash drafter: Qwen3-style layers whose K/V see fused target features (z-lab layout).

Architecture (paper §3; z-lab/dflash `dflash/model.py`):
- `fc: K*H -> H` fuses the K tapped target states, then `hidden_norm` (RMSNorm);
- in *every* layer, K/V come from `[fused context ; block]` through that layer's own k/v projections (+ k_norm,
  RoPE); Q comes from the block only; the context K/V are cached across steps (`DraftKV`), block K/V never are;
- no embedding and no LM head: the block is embedded and decoded by the target's (the adapter's) modules;
- attention inside the block is bidirectional for full layers and causal for sliding layers, unless the
  config says otherwise (see `config._causality`).

Parameter names are the z-lab names (`fc`, `hidden_norm`, `norm`, `layers.N.self_attn.q_proj`, ...), so z-lab
checkpoints load as they are and a saved drafter loads in the upstream code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dflash_zoo.engine.config import DraftConfig
from dflash_zoo.engine.rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from dflash_zoo.engine.sampling import Sampler

# an attention kernel over one call's q and its context / block K/V: (q, k_ctx, v_ctx, k_blk, v_blk, causal,
# window) -> [B, heads, N, hd]
Attend = Callable[..., torch.Tensor]

_ACTS = {  # transformers' ACT2FN of the same names, exactly (config.HIDDEN_ACTS)
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # normalise in fp32, as Qwen3 does
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        if cfg.hidden_act not in _ACTS:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class Span:
    """Positions and visibility of one attention call.

    q_pos [N] or [B, N]: block-token positions (2-D: per batch row, training). ctx_pos [C]: positions of all
    cached + new context tokens (shared by the rows).
    q_limit [N] / [B, N] (optional): a query sees context keys strictly below this position (training: the anchor).
    q_segment [N] / [B, N] (optional): block id of each query; block keys are visible only within a segment.
    """

    q_pos: torch.Tensor
    ctx_pos: torch.Tensor
    q_limit: torch.Tensor | None = None
    q_segment: torch.Tensor | None = None

    def mask(self, causal: bool, window: int | None) -> torch.Tensor | None:
        """Boolean [N, C + N] or [B, N, C + N] (True = attend), or None when every key is visible."""
        if not causal and window is None and self.q_limit is None and self.q_segment is None:
            return None
        q, c = self.q_pos[..., :, None], self.ctx_pos  # [..., N, 1], [C]
        ctx_ok = torch.ones(*q.shape[:-1], len(c), dtype=torch.bool, device=q.device)  # [..., N, C]
        if self.q_limit is not None:
            ctx_ok = ctx_ok & (c < self.q_limit[..., :, None])
        blk_ok = torch.ones_like(q, dtype=torch.bool)  # [..., N, 1], broadcast below
        if self.q_segment is not None:
            blk_ok = blk_ok & (self.q_segment[..., :, None] == self.q_segment[..., None, :])
        if causal:
            blk_ok = blk_ok & (self.q_pos[..., None, :] <= q)
        if window is not None:  # HF windows include the current token: distance < window
            ctx_ok = ctx_ok & (q - c < window)
            blk_ok = blk_ok & (q - self.q_pos[..., None, :] < window)
            if not causal:  # a bidirectional window reaches as far ahead as behind (z-lab `_attention_mask`)
                blk_ok = blk_ok & (self.q_pos[..., None, :] - q < window)
        n = self.q_pos.shape[-1]
        lead = torch.broadcast_shapes(ctx_ok.shape[:-2], blk_ok.shape[:-2])
        ctx_ok = ctx_ok.expand(*lead, n, len(c))
        blk_ok = blk_ok.expand(*lead, n, n)
        return torch.cat([ctx_ok, blk_ok], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.causal = cfg.causal[layer_idx]
        self.window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding_attention" else None

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v  # [B, kvh, T, hd] each

    def forward(self, x, ctx, rope_q, rope_ctx, past, span: Span, attend: Attend | None = None):
        """x [B, N, H] block states; ctx [B, C_new, H] fused new context; past: cached (k, v) or None.
        `attend` replaces the attention kernel (training's block-sparse one), given the same q, K and V.

        Returns the block output [B, N, H] and the updated context (k, v) including `ctx`.
        """
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, *rope_q)  # [B, heads, N, hd]
        k_blk, v_blk = self._kv(x, *rope_q)
        ctx_kv = self._kv(ctx, *rope_ctx) if ctx.shape[1] else None
        if past is not None and ctx_kv is not None:
            ctx_kv = (torch.cat([past[0], ctx_kv[0]], dim=2), torch.cat([past[1], ctx_kv[1]], dim=2))
        ctx_kv = ctx_kv if ctx_kv is not None else past
        if attend is not None:  # every context key is new in a training call
            out = attend(q, ctx_kv[0], ctx_kv[1], k_blk, v_blk, self.causal, self.window)  # [B, heads, N, hd]
            return self.project_out(out, x), ctx_kv
        k, v = (
            (k_blk, v_blk)
            if ctx_kv is None
            else (torch.cat([ctx_kv[0], k_blk], 2), torch.cat([ctx_kv[1], v_blk], 2))
        )
        mask = span.mask(self.causal, self.window)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if mask is None else mask.unsqueeze(-3),  # [1 or B, 1, N, C + N]
            enable_gqa=self.heads != self.kv_heads,
        )  # [B, heads, N, hd]
        return self.project_out(out, x), ctx_kv

    def project_out(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The heads' output [B, heads, N, hd] -> [B, N, H] through `o_proj`; `x` [B, N, H] is the attention's
        input (an output gate reads it: drafters/laguna_dflash.py)."""
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_ctx, past, span, attend=None):
        # the context enters K/V as fused features, without this layer's input norm (z-lab layout)
        attn, ctx_kv = self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_ctx, past, span, attend)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), ctx_kv


@dataclass
class DraftKV:
    """The drafter's context cache: per layer (k, v) of [1, kv_heads, C, head_dim]; block K/V are never kept."""

    layers: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    length: int = 0


class DFlashDrafter(nn.Module):
    """A DFlash draft model. Build with a `DraftConfig`; load with `dflash_zoo.engine.checkpoint.load_drafter`.

    The base of every drafter architecture (dflash_zoo/drafters): a subclass swaps `layer_class` and
    `propose` (DFlash 2: convolutions in each layer, a candidate selector in place of the argmax).
    """

    arch: ClassVar[str] = "dflash"
    static_supported: ClassVar[bool] = True  # the fast engine's static drafter runs it
    layer_class: ClassVar[type[nn.Module]] = DecoderLayer
    raw_block_embedding: ClassVar[bool] = False  # True: embed the block as raw rows (`embed_block`)
    has_selector: ClassVar[bool] = False  # a candidate selector that `selector_off()` can switch off
    use_selector: bool = False  # proposals through the selector (an instance switch where there is one)

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        span: Span,
        cache: DraftKV | None = None,
        attend: Attend | None = None,
    ) -> torch.Tensor:
        """Run one drafting pass.

        Args:
            noise_embedding: [B, N, H] target embeddings of the block(s) (`[bonus] + mask x (B-1)` at inference).
            target_hidden: [B, C_new, K*H] tapped target features of context tokens not yet in `cache`.
            span: positions / visibility; `span.ctx_pos` covers cached + new context.
            cache: context K/V from earlier steps; extended in place with the new context.
            attend: an attention kernel in place of SDPA over `span.mask` (training's block-sparse one):
                `attend(q, k_ctx, v_ctx, k_blk, v_blk, causal, window)` -> [B, heads, N, hd].

        Returns:
            [B, N, H] final-norm hidden states; the caller applies the target's LM head.
        """
        ctx = self.context(target_hidden)  # [B, C_new, H]
        dtype = noise_embedding.dtype
        rope_q = self.rotary_emb(span.q_pos, dtype)  # [N, rot] or [B, N, rot]
        if span.q_pos.dim() == 2:  # per-row positions: broadcast over heads
            rope_q = tuple(t.unsqueeze(1) for t in rope_q)
        rope_ctx = self.rotary_emb(span.ctx_pos[len(span.ctx_pos) - ctx.shape[1] :], dtype)
        x = noise_embedding
        new_layers = []
        for i, layer in enumerate(self.layers):
            past = cache.layers[i] if cache is not None and cache.layers else None
            x, ctx_kv = layer(x, ctx, rope_q, rope_ctx, past, span, attend)
            new_layers.append(ctx_kv)
        if cache is not None:
            cache.layers = new_layers
            cache.length += ctx.shape[1]
        return self.norm(x)

    def context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[B, C, K*H] tapped target features -> [B, C, H] fused context: `hidden_norm(fc(features))`."""
        return self.hidden_norm(self.fc(target_hidden))

    @classmethod
    def state_from_checkpoint(
        cls, cfg: DraftConfig, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors under this module's names (DFlash: the same names)."""
        return state

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint of this architecture stores, under its names (`state_from_checkpoint`'s
        inverse)."""
        return self.state_dict()

    # ---- from final states to proposals (z-lab `compute_logits`, `propose`) ----------------------------
    def embed_block(self, ids: torch.Tensor, adapter: Any) -> torch.Tensor:
        """[1, N] block ids -> [1, N, H]: the target's embedding as its layer 0 sees it; or the raw table rows
        times `input_embedding_scale` (1 when absent) where the config sets it or the architecture says so
        (DFlash 2: upstream bypasses a target's embedding scale or norm, e.g. Muse-Glimmer's)."""
        scale = self.cfg.input_embedding_scale
        if scale is None and not self.raw_block_embedding:
            return adapter.embed(ids)
        return adapter.embed_rows(ids) * (1.0 if scale is None else scale)

    def draft_logits(self, h: torch.Tensor, head: Any) -> torch.Tensor:
        """[..., H] final states -> [..., V]: the target's bare LM head (`head`), times the drafter's
        `output_multiplier`, then its own soft-cap, cap * tanh(x / cap)."""
        x = head(h)
        if self.cfg.output_multiplier != 1.0:
            x = x * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(x / cap) * cap if cap else x

    def propose(
        self, h: torch.Tensor, anchor: torch.Tensor, head: Any, sampler: Sampler, gen: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [n, H] states of slots 1..n, anchor [1] the block's slot-0 token -> (drafts [n], their
        distribution q [n, V], or None when greedy). DFlash: each slot's argmax, or a sample of its own q."""
        return sampler.propose(self.draft_logits(h, head), gen)
