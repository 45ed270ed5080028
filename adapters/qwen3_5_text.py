"""Qwen3.5/3.6 text decoder (`Qwen3_5ForCausalLM`; mirrors transformers `models/qwen3_5/modeling_qwen3_5.py`).

Quirks:
- hybrid layers: `layer_types` repeats `linear_attention` x3 then `full_attention`; the linear layers are
  Gated-DeltaNet (`Qwen3_5GatedDeltaNet` at `layer.linear_attn`), whose recurrent state `Cache.crop` cannot
  rewind: rollback is the GDN recompute (default) or replay of `_hybrid.py`;
- the GDN input projections are separate: `in_proj_qkv` (the conv input, [q | k | v]), `in_proj_a` (decay
  logits) and `in_proj_b` (beta logits); the recompute rollback hooks exactly these three;
- `DynamicCache(config=...)` is required (it builds `LinearAttentionLayer`s), and past recording is turned on
  only after prefill (base `start_decoding`);
- full-attention layers are gated (q_proj doubles as a gate) and use partial rotary: taps are unaffected;
- thinking is on by default in the chat template and the z-lab drafters were benchmarked with it, so no
  template switch is passed.
"""

from __future__ import annotations

from typing import Any

from dflash_zoo.adapters import register
from dflash_zoo.adapters._hybrid import HybridGDNAdapter


@register("qwen3_5_text")
class Qwen3_5TextAdapter(HybridGDNAdapter):
    gdn_capture = ("in_proj_qkv", "in_proj_a", "in_proj_b")
    notes = "hybrid Gated-DeltaNet: exact GDN rollback (recompute; replay as fallback)"

    def gdn_inputs(self, gdn: Any, seen: dict[str, Any]) -> tuple[Any, Any, Any]:
        return seen["in_proj_qkv"], seen["in_proj_a"], seen["in_proj_b"]  # [B, T, C], [B, T, Hv], [B, T, Hv]
