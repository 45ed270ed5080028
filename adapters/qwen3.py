"""Qwen3 dense targets (Qwen/Qwen3-4B, Qwen/Qwen3-8B; mirrors transformers `models/qwen3`).

Quirks:
- plain embeddings and LM head (4B ties them, 8B does not; `get_output_embeddings` covers both);
- all layers full attention, so a negative `crop` of the `DynamicCache` is an exact rollback;
- thinking mode: the published b16 drafters were trained without thinking, so chat prompts are rendered
  with `enable_thinking=False`;
- `<|im_end|>` (151645) ends a turn and is the eos; the mask id 151669 lies past the tokenizer (151668)
  but inside the 151936-row embedding table.
"""

from __future__ import annotations

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import StaticAttention, StaticLayout, TargetAdapter


@register("qwen3")
class Qwen3Adapter(TargetAdapter):
    chat_template_kwargs = {"enable_thinking": False}
    # fast path: Llama's layout plus per-head RMSNorms on q and k before rotary
    static_layout = StaticLayout(
        attention=StaticAttention(q_norm="q_norm", k_norm="k_norm"), cuda_verified=True
    )
