"""gpt-oss targets (openai/gpt-oss-20b, openai/gpt-oss-120b; mirrors transformers `models/gpt_oss/modeling_gpt_oss.py`).

Quirks:
- attention sinks: a learned per-head logit joined to the softmax. They concern only the target; the
  drafter is a plain Qwen3-style block. transformers has no sdpa path for sinks (`_supports_sdpa = False`),
  so the target is loaded with eager attention unless the caller asks for another implementation;
- layers alternate sliding(128) / full attention, sliding first: the cache mixes `DynamicSlidingWindowLayer`
  and `DynamicLayer`. Once a sliding window is full a plain crop raises, so the base class turns on past
  recording after prefill (`start_decoding`) and crops every step (`crop(0)` on a full accept trims the
  recorded history back to the window). Negative crop with recording is exact (docs/compat.md §3);
- harmony chat format: a turn ends on `<|return|>` (200002), a tool call on `<|call|>` (200012), and
  `<|endoftext|>` (199999) is the pad/eos. `extra_stop_token_ids` lists them for the engine to merge with
  the generation config's eos ids;
- fast path: full layers over a static K/V buffer, sliding ones over a ring of window + 2 x block slots,
  sinks joined to every softmax, biased projections, the RMSNorm weight multiplied in fp32 (so its module
  runs), half-width rotary tables over the two halves of a head; the MoE block's router takes the top 4 of
  its biased logits, then softmaxes them; its biased experts interleave gate and up columns and clamp both at
  `limit` before `(up + 1) * gate * sigmoid(alpha * gate)` (declared, so the fast path runs the rule and the
  activation in its own kernels); the block's module returns (states, router scores);
- MoE experts ship as MXFP4; without MXFP4 kernels transformers dequantizes them (20b: about 40 GB in bf16).
"""

from __future__ import annotations

from typing import Any, ClassVar

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import SparseMoE, StaticAttention, StaticLayout, TargetAdapter

HARMONY_RETURN, HARMONY_CALL, HARMONY_ENDOFTEXT = 200002, 200012, 199999


@register("gpt_oss")
class GptOssAdapter(TargetAdapter):
    cache_strategy = "crop-with-recording"  # sliding layers: activate_past_recording after prefill
    extra_stop_token_ids: ClassVar[tuple[int, ...]] = (HARMONY_RETURN, HARMONY_CALL, HARMONY_ENDOFTEXT)
    attn_implementation: ClassVar[str] = "eager"  # sinks: the only exact CPU/GPU path without kernels
    static_layout = StaticLayout(
        attention=StaticAttention(sinks="sinks"),
        mlp=None,
        moe=SparseMoE(router="router", routing="topk_softmax", expert_gate="clamped_swiglu"),
        rotary_halves=True,
        norms="fp32_weight",
        layer_types=("sliding_attention", "full_attention"),
        cuda_verified=True,
    )

    @classmethod
    def load_model(
        cls, directory: str, dtype: Any, device: Any, attn_implementation: str | None = None
    ) -> Any:
        impl = attn_implementation or cls.attn_implementation
        return cls.from_pretrained(directory, dtype, device, attn_implementation=impl)
