"""DeepSeek-V3 text decoders (`deepseek_v3`, the text model of Kimi-K2.5; mirrors transformers
`models/deepseek_v3/modeling_deepseek_v3.py`).

Quirks:
- MLA (multi-head latent attention): q and kv go through low-rank projections (q_lora 1536, kv_lora 512)
  and only 64 of the 192 q/k dims are rotary (`qk_rope_head_dim`). None of it changes what a tap sees, and
  transformers caches the expanded K/V in a plain `DynamicLayer`, so a negative crop is an exact rollback;
- MoE after the first `first_k_dense_replace` dense layers: routed experts (grouped top-k) plus shared
  experts; decoder layers still return the residual stream;
- yarn rope with `mscale` / `mscale_all_dim`: the drafter copies the target's rope, so both must be honoured
  by the drafter's rope (dflash_zoo/engine/rope.py), not here.
"""

from __future__ import annotations

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import TargetAdapter


@register("deepseek_v3")
class DeepseekV3Adapter(TargetAdapter):
    """MLA + MoE on a plain DynamicCache: the base adapter's negative crop is exact."""
