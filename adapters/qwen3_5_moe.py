"""Qwen3.5/3.6 MoE vision-language targets (`Qwen3_5MoeForConditionalGeneration`; mirrors transformers
`models/qwen3_5_moe/modeling_qwen3_5_moe.py`). Covers Qwen3.5-35B-A3B, Qwen3.5-122B-A10B and Qwen3.6-35B-A3B.

Quirks:
- the same VLM wrapper as `qwen3_5` (decoder at `model.model.language_model`, image-text-to-text auto class);
- its text family is `qwen3_5_moe_text`: the hybrid GDN layout and rollback of dense Qwen3.5, MoE MLPs
  (256 experts, top-8 plus one shared expert in the released checkpoints).
"""

from __future__ import annotations

from dflash_zoo.adapters import register
from dflash_zoo.adapters.qwen3_5 import Qwen3_5Adapter
from dflash_zoo.adapters.qwen3_5_moe_text import Qwen3_5MoeTextAdapter


@register("qwen3_5_moe")
class Qwen3_5MoeAdapter(Qwen3_5Adapter):
    text_family = Qwen3_5MoeTextAdapter
    registry_shape = {"model_type": "qwen3_5_moe_text", "gdn_every": 4}
