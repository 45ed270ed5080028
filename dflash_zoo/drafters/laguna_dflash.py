"""Laguna DFlash drafters (`DFlashLagunaForCausalLM`): poolside's drafters for its Laguna targets.

Architecture (vLLM `model_executor/models/laguna_dflash.py`, SGLang `srt/models/dflash.py`; the checkpoint's
tensors as a public port lists them): DFlash layers (engine/drafter.py) with three differences:
- each tapped target layer has its own RMSNorm (`aux_hidden_norms.i`) before `fc` and `hidden_norm`;
- every layer passes the fused context through its own `input_layernorm` before its K/V projections (the
  DFlash layer feeds the context to K/V as it is);
- the attention output is gated before `o_proj`: `out * softplus(g_proj(x))`, x the layer's normed block
  input, softplus in fp32; `gating` "per-head" (the default, also `true`) has one gate per query head,
  "per-element" one per output channel, `false` / "disabled" none.
Quirks:
- the checkpoint stores q/k/v fused (`self_attn.qkv_proj`, rows q then k then v); it is split on loading and
  fused again on saving, so a checkpoint round-trips bit for bit;
- the drafter's `model_type` is "laguna", with `dflash_config` holding the taps, mask id and block size; its
  rope parameters may be nested by layer type like the target's (engine/config.py picks its layers' entry);
- published drafters slide (window 512) and are causal inside the block (`dflash_config.causal`);
- block slot k proposes the token at anchor + k, as DFlash does (no `sample_from_anchor`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dflash_zoo.engine.config import DraftConfig
from dflash_zoo.engine.drafter import Attention, DecoderLayer, DFlashDrafter, RMSNorm
from dflash_zoo.errors import DrafterFormatError

QKV, PARTS = "self_attn.qkv_proj.weight", ("q_proj", "k_proj", "v_proj")


class GatedAttention(Attention):
    """DFlash attention whose output is scaled by softplus(g_proj(x)) before `o_proj`."""

    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        width = self.heads if cfg.attention_gate == "per-head" else self.heads * self.head_dim
        self.g_proj = nn.Linear(cfg.hidden_size, width, bias=False) if cfg.attention_gate else None

    def project_out(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.g_proj is not None:
            b, heads, n, _ = out.shape
            gate = F.softplus(self.g_proj(x).float()).to(out.dtype)  # [B, N, heads] or [B, N, heads * hd]
            # [B, heads, N, hd] * [B, heads, N, 1 or hd]
            out = out * gate.view(b, n, heads, -1).transpose(1, 2)
        return super().project_out(out, x)


class LagunaLayer(DecoderLayer):
    """A DFlash layer with `GatedAttention`, whose context K/V see the context through this layer's input norm."""

    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.self_attn = GatedAttention(cfg, layer_idx)

    def forward(self, x, ctx, rope_q, rope_ctx, past, span, attend=None):
        norm = self.input_layernorm
        attn, ctx_kv = self.self_attn(norm(x), norm(ctx), rope_q, rope_ctx, past, span, attend)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), ctx_kv


class LagunaDrafter(DFlashDrafter):
    """A Laguna DFlash draft model (state-dict names as poolside's, q/k/v split: see the module docstring)."""

    arch: ClassVar[str] = "laguna_dflash"
    static_supported: ClassVar[bool] = False  # the eager engine runs it
    layer_class: ClassVar[type[nn.Module]] = LagunaLayer

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        self.aux_hidden_norms = nn.ModuleList(
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_taps)
        )

    def context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[B, C, K*H] -> [B, C, H]: each tap normed on its own, then `fc` and `hidden_norm`."""
        taps = target_hidden.split(self.cfg.hidden_size, dim=-1)  # K x [B, C, H]
        normed = torch.cat([norm(t) for norm, t in zip(self.aux_hidden_norms, taps, strict=True)], dim=-1)
        return self.hidden_norm(self.fc(normed))

    @classmethod
    def state_from_checkpoint(
        cls, cfg: DraftConfig, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Every layer's fused `qkv_proj` [q + 2 kv, H] split into q_proj / k_proj / v_proj."""
        sizes = [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2
        out = {}
        for name, tensor in state.items():
            if not name.endswith(QKV):
                out[name] = tensor
                continue
            if tensor.dim() != 2 or tensor.shape[0] != sum(sizes):
                raise DrafterFormatError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}; the config's q/k/v need {sum(sizes)} rows "
                    f"({' + '.join(map(str, sizes))})",
                    hint="the config.json and the weights come from different drafters",
                )
            prefix = name.removesuffix("qkv_proj.weight")
            names = [f"{prefix}{p}.weight" for p in PARTS]
            both = [n for n in names if n in state]
            if both:  # one of the two copies would be dropped
                raise DrafterFormatError(
                    f"tensor {name!r} and {', '.join(both)} both hold that layer's q/k/v"
                )
            out.update(zip(names, tensor.split(sizes), strict=True))
        return out

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The state dict with each layer's q/k/v fused into `qkv_proj`, as poolside's checkpoints store them."""
        state = dict(self.state_dict())
        for i in range(len(self.layers)):
            prefix = f"layers.{i}.self_attn."
            parts = [state.pop(f"{prefix}{p}.weight") for p in PARTS]
            state[f"layers.{i}.{QKV}"] = torch.cat(parts, dim=0)
        return state
