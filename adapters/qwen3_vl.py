"""Qwen3-VL targets (Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration; mirrors transformers
`models/qwen3_vl/modeling_qwen3_vl.py`).

Quirks:
- VLM wrapper: the decoder lives at `model.language_model` (Qwen3-style layers with q/k norm); the LM
  head is `lm_head` on the wrapper; there is no `AutoModelForCausalLM` mapping, so the target loads through
  `AutoModelForImageTextToText`;
- interleaved mRoPE: text positions are (t, h, w) triples. After an image, text positions are shifted by
  `rope_deltas`, which transformers computes at prefill (cache length 0, with `mm_token_type_ids` and
  `image_grid_thw`) and keeps on the inner model (`model.model.rope_deltas`). Later text-only forwards
  on the same cache read it back (position = cache length + delta), so a negative crop stays exact.
  The value outlives the generation, though: a text-only prompt after an image prompt would reuse the
  stale delta from its second forward on. `new_cache` therefore clears it before every prefill;
- deepstack: visual features are added to the first decoder layers' outputs at image positions during
  prefill only; taps see them as the target's own hidden states;
- images (`accepts_images`): pixel values, `image_grid_thw` and `mm_token_type_ids` go to the prefill only;
- fast path (text prompts; an image prompt runs the eager engine): Qwen3's layout (q/k norms) with the text
  model's rotary embedding, fed mRoPE position ids (a text prompt: the same position on every axis); the MoE
  variant's sparse blocks run as their modules.
"""

from __future__ import annotations

from typing import Any

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import SparseMoE, StaticAttention, StaticLayout, TargetAdapter


@register("qwen3_vl")
class Qwen3VLAdapter(TargetAdapter):
    layers_path = "model.language_model.layers"
    auto_class = "AutoModelForImageTextToText"
    accepts_images = True
    static_layout = StaticLayout(
        attention=StaticAttention(q_norm="q_norm", k_norm="k_norm"),
        moe=SparseMoE(routing="softmax_topk", expert_gate="silu"),  # Qwen3-VL-MoE: always renormalised
        rotary_emb="model.language_model.rotary_emb",
        rotary_axes=3,
        cuda_verified=True,
    )

    def new_cache(self) -> Any:
        self.model.model.rope_deltas = None  # stale deltas from an earlier image prompt would shift positions
        return super().new_cache()


@register("qwen3_vl_moe")
class Qwen3VLMoeAdapter(Qwen3VLAdapter):
    """The VLM wrapper over the MoE text model (the static layout's `SparseMoE` finds its sparse blocks)."""
