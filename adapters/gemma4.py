"""Gemma 4 VLM targets (google/gemma-4-31B-it, google/gemma-4-26B-A4B-it: Gemma4ForConditionalGeneration;
mirrors transformers `models/gemma4/modeling_gemma4.py`). Gemma 4 12B is `gemma4_unified` (its own adapter).

Quirks (on top of `gemma4_text`, whose embed scale, soft-cap, sliding and KV-sharing handling it inherits):
- the decoder lives at `model.language_model`; shapes come from `config.get_text_config()`;
- the head is tied to the scaled embedding table (`lm_head.weight` is `embed_tokens.weight`; the sqrt(H)
  scale applies to inputs only);
- images (`accepts_images`): the processor expands the image placeholder, `pixel_values` and
  `image_position_ids` go to the prefill forward only (dflash_zoo/engine/vision.py). Gemma 4 uses plain 1-D
  positions, so text-only verify forwards on the same cache need no extra state. Image tokens attend
  bidirectionally inside their block at prefill (`mm_token_type_ids`); later tokens are causal anyway;
- the 26B-A4B MoE runs a dense FFN beside the experts; neither changes what a tap sees;
- fast path (text prompts; an image prompt runs the eager engine): the text family's layout with the wrapped
  text model's rotary embedding.
"""

from __future__ import annotations

import dataclasses

from dflash_zoo.adapters import register
from dflash_zoo.adapters.gemma4_text import Gemma4TextAdapter


@register("gemma4")
class Gemma4Adapter(Gemma4TextAdapter):
    layers_path = "model.language_model.layers"
    auto_class = "AutoModelForImageTextToText"
    accepts_images = True
    registry_shape = {"model_type": "gemma4_text", "final_logit_softcapping": 30.0}  # the text config's
    static_layout = dataclasses.replace(
        Gemma4TextAdapter.static_layout, rotary_emb="model.language_model.rotary_emb"
    )
