"""Qwen3.5/3.6 vision-language targets (`Qwen3_5ForConditionalGeneration`; mirrors transformers
`models/qwen3_5/modeling_qwen3_5.py`). Covers Qwen/Qwen3.5-4B/9B/27B and Qwen/Qwen3.6-27B.

Quirks:
- a VLM wrapper: the decoder is `model.model.language_model` (`Qwen3_5TextModel`), the head `model.lm_head`;
  the top-level `get_input_embeddings` / `get_output_embeddings` reach both, so embed/logits are the defaults;
- loaded with `AutoModelForImageTextToText`: `AutoModelForCausalLM` maps `qwen3_5` to the text-only class,
  which drops the vision tower. Text-only `model(input_ids=...)` works (1-D positions expand to mRoPE);
- the image is seen at prefill only (`pixel_values` through `forward(**extra)`); the replay rollback runs the
  whole wrapper so mRoPE position offsets (`rope_deltas`) stay those of the prefill;
- everything about the cache comes from the text family by composition: `self.text` is a `qwen3_5_text`
  adapter on the same model with this wrapper's layer path (GDN recompute rollback, replay fallback);
- fast path (text prompts; an image prompt runs the eager engine): the text family's layout with the
  rotary embedding of the wrapped text model;
- the shapes live in `text_config`; a composite config without one is refused by `validate`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from dflash_zoo.adapters import register
from dflash_zoo.adapters._hybrid import HybridGDNAdapter
from dflash_zoo.adapters.base import Problem, TargetAdapter
from dflash_zoo.adapters.qwen3_5_text import HYBRID_LAYOUT, Qwen3_5TextAdapter


@register("qwen3_5")
class Qwen3_5Adapter(TargetAdapter):
    text_family: ClassVar[type[HybridGDNAdapter]] = Qwen3_5TextAdapter
    layers_path = "model.language_model.layers"
    auto_class = "AutoModelForImageTextToText"
    cache_strategy = "gdn-recompute"
    accepts_images = True
    registry_shape = {"model_type": "qwen3_5_text", "gdn_every": 4}  # 3 Gated-DeltaNet : 1 full attention
    static_layout = dataclasses.replace(HYBRID_LAYOUT, rotary_emb="model.language_model.rotary_emb")

    def __init__(self, model: Any, rollback: str = "recompute"):
        super().__init__(model)
        self.text = self.text_family(model, rollback=rollback, layers_path=self.layers_path)
        self.cache_strategy = self.text.cache_strategy

    @classmethod
    def validate(cls, target_config: dict[str, Any], draft: Any) -> list[Problem]:
        if not isinstance(target_config.get("text_config"), dict):
            return [Problem("FAIL", "text_config", f"{cls.model_types[0]} config has no text_config section")]
        return cls.text_family.validate(target_config, draft)

    def new_cache(self) -> Any:
        if hasattr(self.model.model, "rope_deltas"):
            self.model.model.rope_deltas = (
                None  # an earlier image prompt's mRoPE shift must not leak into this one
            )
        return super().new_cache()

    def snapshot(self, cache: Any) -> Any:
        return self.text.snapshot(cache)

    def rollback(self, cache: Any, num_rejected: int, snapshot: Any, committed_ids: Any) -> None:
        self.text.rollback(cache, num_rejected, snapshot, committed_ids)

    def gdn_split(self, gdn: Any, outs: tuple[Any, ...]) -> tuple[Any, Any, Any, Any]:
        return self.text.gdn_split(gdn, outs)
