"""Muse-Glimmer VLM targets (meta-models/Muse-Glimmer-30B: MuseGlimmerForConditionalGeneration; mirrors
transformers `models/muse_glimmer/modeling_muse_glimmer.py`). Its published drafter is a DFlash 2 drafter.

Quirks:
- a VLM wrapper (Kimi-K2.5's layout): the decoder is `model.language_model`, loaded through
  `AutoModelForImageTextToText` (no causal-LM class maps `muse_glimmer`); shapes live in `text_config`;
- normed embeddings: `MuseGlimmerTextNormedEmbedding` applies a weightless RMSNorm inside its `forward`, so
  `embed` (what layer 0 sees) goes through the module, while `embed_rows` (the base class's raw table rows) is
  what a DFlash 2 drafter scales by its own `input_embedding_scale`;
- logits: the bare head times `output_multiplier` (0.196 = 1/sqrt(H / 256) on the released checkpoint), then a
  tanh soft-cap (20): `logits` repeats the target's four operations in its order; `head` stays the bare head,
  which the drafter scales and caps with its own `output_multiplier` / `final_logit_softcapping`;
- sliding(2048) : full layers 3:1 (the full ones are NoPE), so the cache mixes sliding and full layers: past
  recording after prefill, then negative crop (base class);
- attention: one weightless RMSNorm on q and k, q times `qk_scale_factor`, the output times sigmoid of a gate
  projection of the layer input; zero-centred (1 + weight) sandwich norms with a separate `post_norm_eps`;
- no static layout: the fast engine would need a q scale after a weightless shared q/k norm, an output gate
  projected from the layer input (not from q_proj), rotary-free (NoPE) full layers and a second norm epsilon.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import Problem, TargetAdapter

if TYPE_CHECKING:
    import torch

    from dflash_zoo.engine.config import DraftConfig


@register("muse_glimmer")
class MuseGlimmerAdapter(TargetAdapter):
    layers_path = "model.language_model.layers"
    auto_class = "AutoModelForImageTextToText"
    cache_strategy = "crop-with-recording"
    registry_shape = {"model_type": "muse_glimmer_text", "final_logit_softcapping": 20.0}

    @classmethod
    def validate(cls, target_config: dict[str, Any], draft: DraftConfig) -> list[Problem]:
        if not isinstance(target_config.get("text_config"), dict):
            return [Problem("FAIL", "text_config", "muse_glimmer config has no text_config section")]
        problems = super().validate(target_config, draft)
        text = target_config["text_config"]
        pairs = (
            ("softcap", draft.final_logit_softcapping, text.get("final_logit_softcapping")),
            ("output_multiplier", draft.output_multiplier, text.get("output_multiplier")),
        )
        for code, mine, target in pairs:
            if target is not None and mine != target:  # drafts scaled unlike the target: sampling's q is off
                problems.append(Problem("WARN", code, f"drafter {code} {mine} != target {target}"))
        return problems

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [B, T, V]: head, times `output_multiplier`, soft-capped, as the target's forward."""
        import torch

        text = self.text_config
        logits = self.head(h) * text.output_multiplier
        cap = text.final_logit_softcapping
        return torch.tanh(logits / cap) * cap
