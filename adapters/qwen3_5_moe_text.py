"""Qwen3.5/3.6 MoE text decoder (`Qwen3_5MoeForCausalLM`; mirrors transformers `models/qwen3_5_moe`).

Quirks:
- same hybrid layout and Gated-DeltaNet modules as the dense `qwen3_5_text` (3 GDN : 1 full), so the same
  exact GDN rollback; the sparse MoE block (top-8 of 256 experts plus a shared expert in the released models)
  only changes the MLP, which taps and rollback never look inside;
- the text config has no dense `intermediate_size` (experts use `moe_intermediate_size`).
"""

from __future__ import annotations

from dflash_zoo.adapters import register
from dflash_zoo.adapters.qwen3_5_text import Qwen3_5TextAdapter


@register("qwen3_5_moe_text")
class Qwen3_5MoeTextAdapter(Qwen3_5TextAdapter):
    pass
