"""Laguna targets (poolside/Laguna-S-2.1, poolside/laguna-XS.2: LagunaForCausalLM; mirrors transformers
`models/laguna/modeling_laguna.py`).

Quirks:
- sliding and full attention layers per `layer_types` (window `sliding_window`): the cache mixes sliding and
  full layers, so past recording after prefill, then negative crop (base class), exact;
- rotary tables per layer type (`rope_parameters` keyed by layer type; full layers rotate half the head),
  per-layer query-head counts (`num_attention_heads_per_layer`), per-head q/k RMSNorms, and a softplus output
  gate (`g_proj`, one value per head or per channel): none of it changes what a tap sees;
- MoE after the dense first layer: sigmoid routing with a score-correction bias (optionally soft-capped router
  logits), the routed sum times `moe_routed_scaling_factor`, plus an ungated shared expert;
- plain embeddings and LM head; no logit soft-cap;
- no static layout: the fast engine would need the softplus output gate from its own projection, per-layer
  head counts, and a MoE block with an ungated shared expert and a routed scale (SparseMoE gates the shared
  expert with a sigmoid and has no scale).
"""

from __future__ import annotations

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import TargetAdapter


@register("laguna")
class LagunaAdapter(TargetAdapter):
    cache_strategy = "crop-with-recording"
