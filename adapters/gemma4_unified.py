"""Gemma 4 unified targets (google/gemma-4-12B-it: Gemma4UnifiedForConditionalGeneration, model type
`gemma4_unified`; mirrors transformers `models/gemma4_unified/modeling_gemma4_unified.py`).

Quirks (on top of `gemma4_text`, whose embed scale, soft-cap, sliding and KV-sharing handling it inherits):
- encoder-free multimodality: no vision or audio tower, image patches and audio frames are projected straight
  into the text width at prefill; the decoder lives at `model.language_model` and is the Gemma 4 text decoder
  without per-layer inputs or an MoE branch (sandwich norms, q/k/v norms, K = V and KV-shared layers where the
  config asks for them, the layer scalar);
- `gemma4_unified` is its own transformers model type (5.17 and newer): it used to be taken for an alias of
  `gemma4`, whose wrapper class it is not;
- sliding(1024) : full layers 5:1, so the cache mixes sliding and full layers: past recording after prefill,
  then negative crop (base class); KV-shared layers write nothing to the cache;
- image prompts are not offered (`accepts_images` off) until the unified processor's prefill inputs are tested;
- fast path (cuda_verified off until the GPU matrix passes): the Gemma 4 text layout without per-layer inputs
  and experts, with the wrapped text model's rotary embedding.
"""

from __future__ import annotations

import dataclasses

from dflash_zoo.adapters import register
from dflash_zoo.adapters.gemma4_text import Gemma4TextAdapter


@register("gemma4_unified")
class Gemma4UnifiedAdapter(Gemma4TextAdapter):
    layers_path = "model.language_model.layers"
    auto_class = "AutoModelForImageTextToText"
    registry_shape = {
        "model_type": "gemma4_unified_text",
        "final_logit_softcapping": 30.0,
    }  # the text config's
    static_layout = dataclasses.replace(
        Gemma4TextAdapter.static_layout,
        rotary_emb="model.language_model.rotary_emb",
        per_layer_input=None,
        parallel_moe=None,
        cuda_verified=False,
    )
