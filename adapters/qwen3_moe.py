"""Qwen3 mixture-of-experts targets (Qwen/Qwen3-Coder-30B-A3B-Instruct; transformers `models/qwen3_moe`).

Quirks:
- same decoder layout and cache as dense Qwen3 (full attention, negative crop is exact);
- the sparse MoE block does not change what a tap sees: decoder layers still return the residual stream;
- Qwen3-Coder has no thinking mode, so no template switch is passed.
"""

from __future__ import annotations

from . import register
from .base import TargetAdapter


@register("qwen3_moe")
class Qwen3MoeAdapter(TargetAdapter):
    pass
