"""Bench shapes: random-weight targets with the layer sizes of published models, and their drafters.

A `Shape` holds what a target's `config.json` says (hidden size, layers, heads, FFN, rope, and the family's own
fields in `extra`) plus the shape of the z-lab DFlash drafter published for it (`draft_*` and `draft`).
`shape_target` builds the target from its transformers config class directly on a device (`meta` costs no
memory); `shape_drafter` builds the drafter. Nothing is downloaded; weights are random.

Rules every shape follows:
- values are the published `config.json` ones (the comment next to a shape names the repo); a field the config
  does not give is the transformers config class default, and the comment says so;
- VLM targets (Qwen3.5/3.6/3.8, Gemma 4) are benchmarked as their text model (`qwen3_5_text`, `qwen3_5_moe_text`,
  `gemma4_text`): the vision tower only runs at prefill on images, which a text bench never feeds. A wrapper
  whose text model has no causal-LM class (`muse_glimmer`), or no adapter of its own (`gemma4_unified`, whose
  adapter is the wrapper's), is built whole (`WRAPPED`), its vision parts with the config class defaults
  (weights a text bench never reads);
- a DFlash 2 drafter (`Shape.dflash2`: its convolution and selector sizes) is built as `DFlash2DraftModel`;
  another architecture is named by `architectures` in `Shape.draft` (Laguna's `DFlashLagunaForCausalLM`), and
  `Shape.draft` keys under `dflash_config` join the built ones; `Shape.draft_tap_ids` gives a drafter's
  published taps where they do not follow the default rule;
- everything is built in the bench dtype (bf16), also where a checkpoint ships another format (gpt-oss's MXFP4
  experts): a shape measures the bf16 model;
- the drafter's `mask_token_id` only selects the embedding row of the masked block slots, so where the id at a
  drafter's `main` revision is unknown the value seen in another upload is used (it changes no timing);
- `max_position_embeddings` is the bench's (40960, or what prompt + new tokens need; gpt-oss: its own 131072,
  which its yarn factor implies): rotary angles are computed per position, so no weight depends on it.

Longer than the ~300 lines we aim for: one table of shapes, each with its sources, read together.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Shape:
    """A target shape (+ a random drafter for it). ffn: target intermediate size.

    ffn is the dense MLP width (`intermediate_size`); `qwen3_5_moe_text` has no dense MLP, so there it is the
    shared expert's width (`shared_expert_intermediate_size`, `FFN_KEYS`).
    draft: fields of the drafter's own `config.json` (heads, FFN, layer types, ...) that replace the legacy
    rule of `shape_drafter`; empty for the shapes written before drafters were described field by field.
    """

    model_type: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float
    mask_token_id: int
    draft_layers: int = 5
    draft_taps: int = 5
    block_size: int = 16
    extra: dict = field(default_factory=dict)
    draft: dict = field(default_factory=dict)
    draft_tap_ids: tuple[int, ...] = ()  # the published taps; empty: the default rule over `draft_taps`
    dflash2: dict = field(default_factory=dict)  # DFlash 2 `dflash_config` keys; empty: a DFlash drafter


# config key that `Shape.ffn` fills, where it is not `intermediate_size`
FFN_KEYS = {"qwen3_5_moe_text": "shared_expert_intermediate_size"}
# VLM wrappers built whole (their text model has no causal-LM class or no adapter): the shape's fields go into
# `text_config`
WRAPPED = {"muse_glimmer", "gemma4_unified"}
# hybrid Gated-DeltaNet families: rotary on a quarter of the head (their config class default, 0.25)
PARTIAL_ROTARY = {"qwen3_5_text": 0.25, "qwen3_5_moe_text": 0.25}
# drafter-config keys that name the drafter's own architecture: `--draft-arch` drops them to build another
ARCH_KEYS = ("architectures", "model_type", "gating")


def zlab_drafter(
    ffn: int,
    sliding: int = 5,
    full: int = 1,
    window: int = 4096,
    heads: int = 32,
    kv_heads: int = 8,
    **more: Any,
) -> dict[str, Any]:
    """The fields of a newer z-lab drafter config.json: `sliding` sliding-window layers then `full` full ones,
    `heads` q / `kv_heads` kv heads of 128, FFN `ffn`, and any further fields (`more`)."""
    return {
        "layer_types": [SLIDING] * sliding + [FULL] * full,
        "sliding_window": window,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 128,
        **more,
    }


CODER_MOE = {  # the MoE fields of Qwen3-Coder-30B-A3B-Instruct's config.json (docs/families.md)
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
}

# ---- the Qwen3.5 / 3.6 family (hybrid: 3 Gated-DeltaNet layers to 1 gated full-attention layer) ----------
# Gated-DeltaNet fields shared by every Qwen3.5/3.6 text config: conv kernel 4, key/value head dim 128,
# 16 key heads; value heads differ by size (`linear_num_value_heads`). Their `full_attention_interval` is 4,
# which is the config class's default layer pattern ([linear x3, full] repeated), so it is not passed.
_GDN = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
}
QWEN35_4B = {**_GDN, "linear_num_value_heads": 32, "tie_word_embeddings": True}
QWEN35_9B = {**_GDN, "linear_num_value_heads": 32}  # equal to the qwen3_5_text defaults; untied
QWEN35_27B = {**_GDN, "linear_num_value_heads": 48}  # Qwen3.5-27B and Qwen3.6-27B: untied
QWEN35_MOE = {  # Qwen3.5-35B-A3B and Qwen3.6-35B-A3B: 256 experts, top 8, one gated shared expert; untied
    **_GDN,
    "linear_num_value_heads": 32,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
}

# ---- Qwen3.8 (the Qwen3.5 architecture: `qwen3_5`) and its DFlash 2 drafter ----------------------------------
# z-lab/Qwen3.8-27B-DFlash2 config.json (commit 50307d4c): 5 sliding(2048) layers, 32 q / 8 kv heads of 128, FFN
# 17408, block 8, taps [5, 19, 33, 47, 61], mask 248070; the DFlash 2 parts below. Its rope is not public: the
# target's theta (1e7) is used, as for the other Qwen3.x drafters
QWEN38_DRAFT = zlab_drafter(17408, sliding=5, full=0, window=2048)
DFLASH2_SELECTOR = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}

# ---- Muse-Glimmer (VLM wrapper; sliding(2048) : NoPE full 3:1, the class default pattern) --------------------
# transformers `MuseGlimmerTextConfig` defaults, which its docstring gives as the released checkpoint's
# (meta-models/Muse-Glimmer-30B): soft-cap 20, output multiplier 1/sqrt(6656 / 256); untied head
MUSE_GLIMMER = {
    "sliding_window": 2048,
    "final_logit_softcapping": 20.0,
    "output_multiplier": 0.19611613513818404,
}
# z-lab/Muse-Glimmer-30B-DFlash2 config.json (= z-lab/dflash `tests/fixtures/dflash2-config.json`): 5
# sliding(2048) layers, 32 q / 8 kv heads of 128, FFN 19968, rope theta 5e5, eps 1e-5, block 16, taps
# [1, 13, 25, 37, 49], mask 201818, the target's output multiplier and soft-cap on its draft logits
MUSE_GLIMMER_DRAFT = zlab_drafter(
    19968,
    sliding=5,
    full=0,
    window=2048,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    final_logit_softcapping=20.0,
    output_multiplier=0.19611613513818404,
)

# ---- gpt-oss (MoE in every layer; sliding(128) and full layers alternate, sliding first: the class default) -
GPT_OSS_20B = {
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,  # = 32 x 4096, the yarn-extended context
    "rope_parameters": {  # yarn x32 over a 4096-token pretraining context
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}
GPT_OSS_DRAFT = {  # z-lab/gpt-oss-20b-DFlash config.json: head dim 64, biased attention, 8 full layers
    "intermediate_size": 7680,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "attention_bias": True,
    "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096},
}

# ---- Gemma 4 (sliding(1024) : full layers 5:1, the class default pattern; full layers have their own head dim
# and KV heads, K = V; soft-capped logits; tied head; no per-layer input embeddings on 31B / 26B) ------------
_GEMMA4 = {
    "global_head_dim": 512,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    },
}
GEMMA4_31B = {**_GEMMA4, "num_global_key_value_heads": 4}
GEMMA4_26B = {  # a dense MLP (ffn) and 128 routed experts (top 8) side by side in every layer
    **_GEMMA4,
    "num_global_key_value_heads": 2,
    "enable_moe_block": True,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
}
# google/gemma-4-12B-it (`gemma4_unified`): transformers' 12B conversion variant (`_VARIANT_GEMMA_4_12B` in
# `models/gemma4_unified/convert_gemma4_unified_weights.py`): one KV head of 512 (K = V) on full layers, no
# KV-shared layers, per-layer inputs or experts, the Gemma 4 rope pair above
GEMMA4_12B = {**_GEMMA4, "num_global_key_value_heads": 1}

# ---- Laguna (MoE after a dense first layer, sigmoid routing, a softplus gate per attention head) ---------------
# poolside/Laguna-XS-2.1 at c405648 as a public benchmark fixture quotes its config.json
# (Layr-Labs/mlxfast-challenge-dev `fixtures/laguna_xs_2_1_dflash_track.json`): 256 experts of 512 (top 8), a
# shared expert of 512, layer 0 dense (the class default `mlp_layer_types`), window 512. The quote gives no
# heads, layer types or rope: LagunaConfig's defaults (48 q heads, every layer full attention, its per-layer-type
# rope: `None` lets the class fill it in). One third-party description gives the shared expert 8192: not used
LAGUNA_XS = {
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "sliding_window": 512,
    "rope_parameters": None,
}
# poolside/Laguna-XS-2.1-DFlash config.json at 5c36361 (the same fixture; the model card names the class): 5
# sliding(512) layers, causal in the block, 64 q / 8 kv heads of 128, FFN 8192, block 16, taps [1, 13, 25, 33,
# 39], mask 12. Its gate is per head (the default, `gating` absent): the only width that fits the published
# 924,135,848 bytes. Rope theta 5e5 from its NVFP4 copy's config (docs/families.md)
LAGUNA_XS_DRAFT = {
    "architectures": ["DFlashLagunaForCausalLM"],
    "model_type": "laguna_dflash",
    "layer_types": [SLIDING] * 5,
    "sliding_window": 512,
    "intermediate_size": 8192,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "dflash_config": {"causal": True},
}

# the targets' and z-lab drafters' config.json (docs/families.md): H, L, V, q/kv/hd; drafter FFN, B, mask id.
# Target FFN: Qwen3-8B 12288 (= its drafter's); Llama-3.1-8B 14336 (its config.json); Qwen3.5-9B: 12288, the
# value of its config.json and of the qwen3_5_text config default.
# fmt: off
SHAPES: dict[str, Shape] = {
    "qwen3-8b": Shape("qwen3", 4096, 36, 151936, 32, 8, 128, 12288, 1e6, 151669),
    "qwen3-4b": Shape(
        "qwen3", 2560, 36, 151936, 32, 8, 128, 9728, 1e6, 151669, extra={"tie_word_embeddings": True}
    ),
    "llama-3.1-8b": Shape("llama", 4096, 32, 128256, 32, 8, 128, 14336, 5e5, 128255, block_size=10),
    # Qwen/Qwen3.5-9B config.json (its text_config): GDN 16 key / 32 value heads of 128, conv 4, every 4th layer
    # full attention, rope theta 1e7 on a quarter of the head. Drafter: the older z-lab/Qwen3.5-9B-DFlash
    # upload (5 full layers, taps [1, 8, 15, 22, 29], mask 248070), the one this shape was added with and kept
    # unchanged; `main` now holds 6 layers and 8 taps (registry.yaml).
    "qwen3.5-9b": Shape("qwen3_5_text", 4096, 32, 248320, 16, 4, 256, 12288, 1e7, 248070, extra=QWEN35_9B),
    # Qwen3-Coder-30B-A3B (48 layers of 128 experts, top 8; rope theta 1e7 assumed: no source states it, see
    # docs/families.md) and its 8-layer drafter (FFN 6144 = the target's dense intermediate size)
    "qwen3-coder-30b-a3b": Shape(
        "qwen3_moe", 2048, 48, 151936, 32, 4, 128, 6144, 1e7, 151669, draft_layers=8, extra=CODER_MOE
    ),
    # Qwen3-32B's config.json (no published drafter: a capacity shape for `--devices`, ~65 GB in bf16)
    "qwen3-32b": Shape("qwen3", 5120, 64, 151936, 64, 8, 128, 25600, 1e6, 151669),
    # Qwen/Qwen3.5-4B config.json (text_config; tied embeddings). Drafter: z-lab/Qwen3.5-4B-DFlash config.json,
    # 5 sliding(4096) + 1 full layers, 32 q / 8 kv heads of 128, FFN 9216, 8 taps; its mask id at `main` is
    # not known (248070 / 248077 by upload), 248070 is used.
    "qwen3.5-4b": Shape(
        "qwen3_5_text", 2560, 32, 248320, 16, 4, 256, 9216, 1e7, 248070, draft_layers=6, draft_taps=8,
        extra=QWEN35_4B, draft=zlab_drafter(9216),
    ),
    # Qwen/Qwen3.5-27B config.json (text_config): 24 q / 4 kv heads of 256, GDN 16 key / 48 value heads.
    # Drafter: z-lab/Qwen3.5-27B-DFlash config.json, 5 sliding(4096) + 1 full, FFN 17408, 8 taps; mask 248077
    # as seen in a published upload (the id at `main` is not recorded).
    "qwen3.5-27b": Shape(
        "qwen3_5_text", 5120, 64, 248320, 24, 4, 256, 17408, 1e7, 248077, draft_layers=6, draft_taps=8,
        extra=QWEN35_27B, draft=zlab_drafter(17408),
    ),
    # Qwen/Qwen3.6-27B config.json (text_config): the same text shape as Qwen3.5-27B. Drafter:
    # z-lab/Qwen3.6-27B-DFlash config.json, 4 sliding(2048) + 1 full, FFN 17408, 5 taps, mask 248070; its rope
    # is not verified (the registry notes yarn), the target's theta 1e7 with default rope is used.
    "qwen3.6-27b": Shape(
        "qwen3_5_text", 5120, 64, 248320, 24, 4, 256, 17408, 1e7, 248070, draft_layers=5, draft_taps=5,
        extra=QWEN35_27B, draft=zlab_drafter(17408, sliding=4, window=2048),
    ),
    # Qwen/Qwen3.5-35B-A3B config.json (text_config): 40 layers, 16 q / 2 kv heads of 256, GDN 16 key / 32
    # value heads, 256 experts of 512 (top 8) plus a shared expert of 512 (ffn). Drafter:
    # z-lab/Qwen3.5-35B-A3B-DFlash config.json, 5 sliding(4096) + 1 full, FFN 6144, 8 taps; mask 248077 as
    # seen in its 6-layer upload (the id at `main` is not recorded).
    "qwen3.5-35b-a3b": Shape(
        "qwen3_5_moe_text", 2048, 40, 248320, 16, 2, 256, 512, 1e7, 248077, draft_layers=6, draft_taps=8,
        extra=QWEN35_MOE, draft=zlab_drafter(6144),
    ),
    # Qwen/Qwen3.6-35B-A3B config.json (text_config): the same text shape as Qwen3.5-35B-A3B. Drafter:
    # z-lab/Qwen3.6-35B-A3B-DFlash config.json, the same shape as the 3.5 drafter; its mask id at `main` is not
    # known, 248070 (an earlier upload's) is used.
    "qwen3.6-35b-a3b": Shape(
        "qwen3_5_moe_text", 2048, 40, 248320, 16, 2, 256, 512, 1e7, 248070, draft_layers=6, draft_taps=8,
        extra=QWEN35_MOE, draft=zlab_drafter(6144),
    ),
    # openai/gpt-oss-20b config.json: 24 layers, 64 q / 8 kv heads of 64, 32 experts of 2880 (top 4), attention
    # sinks; the checkpoint's MXFP4 experts are bf16 here. Drafter: z-lab/gpt-oss-20b-DFlash config.json,
    # 8 layers, block 8, mask 200000, 5 taps.
    "gpt-oss-20b": Shape(
        "gpt_oss", 2880, 24, 201088, 64, 8, 64, 2880, 150000.0, 200000, draft_layers=8, block_size=8,
        extra=GPT_OSS_20B, draft=GPT_OSS_DRAFT,
    ),
    # google/gemma-4-31B-it config.json (text_config): 60 layers, 32 q heads, 16 kv heads of 256 on sliding
    # layers and 4 of 512 (K = V) on full ones, FFN 21504. Drafter: z-lab/gemma-4-31B-it-DFlash config.json,
    # 4 sliding(2048) + 1 full layers, 64 q / 8 kv heads of 128, FFN 10752, rope theta 1e6, soft-cap 30,
    # block 16, mask 4, 6 taps.
    "gemma-4-31b-it": Shape(
        "gemma4_text", 5376, 60, 262144, 32, 16, 256, 21504, 1e6, 4, draft_layers=5, draft_taps=6,
        extra=GEMMA4_31B,
        draft=zlab_drafter(10752, sliding=4, window=2048, heads=64, final_logit_softcapping=30.0),
    ),
    # google/gemma-4-26B-A4B-it config.json (text_config): 30 layers, 16 q heads, 8 kv heads of 256 on sliding
    # layers and 2 of 512 (K = V) on full ones, dense FFN 2112 beside 128 experts of 704 (top 8). Drafter:
    # z-lab/gemma-4-26B-A4B-it-DFlash config.json, 4 sliding(2048) + 1 full layers, 32 q / 8 kv heads of 128,
    # FFN 5632, rope theta 1e6, soft-cap 30, block 16, 6 taps; its config gives no mask id, 4 (the 31B
    # drafter's) is used.
    "gemma-4-26b-a4b-it": Shape(
        "gemma4_text", 2816, 30, 262144, 16, 8, 256, 2112, 1e6, 4, draft_layers=5, draft_taps=6,
        extra=GEMMA4_26B,
        draft=zlab_drafter(5632, sliding=4, window=2048, final_logit_softcapping=30.0),
    ),
    # google/gemma-4-12B-it (GEMMA4_12B, built as the whole `gemma4_unified` wrapper): 48 layers, 16 q / 8 kv heads
    # of 256 on sliding layers, FFN 15360, vocab 262144 (the text config's default). Drafter:
    # z-lab/gemma4-12B-it-DFlash config.json as the DFlash 2 notes of the public Crssz/r4dx repository (§13.1)
    # read it (one third-party source): 4 sliding(2048) + 1 full layers, 32 q / 8 kv heads of 128, FFN 7680,
    # rope theta 1e6, eps 1e-6, soft-cap 30, block 16, mask 4, 6 taps (the default rule)
    "gemma4-12b-it": Shape(
        "gemma4_unified", 3840, 48, 262144, 16, 8, 256, 15360, 1e6, 4, draft_layers=5, draft_taps=6,
        extra=GEMMA4_12B,
        draft=zlab_drafter(7680, sliding=4, window=2048, final_logit_softcapping=30.0),
    ),
    # poolside/Laguna-XS-2.1 (LAGUNA_XS): 40 layers, 48 q / 8 kv heads of 128 (class default; head dim quoted),
    # FFN 8192, vocab 100352; its drafter (LAGUNA_XS_DRAFT) runs on the eager engine only
    "laguna-xs-2.1": Shape(
        "laguna", 2048, 40, 100352, 48, 8, 128, 8192, 5e5, 12, draft_layers=5, draft_taps=5,
        extra=LAGUNA_XS, draft=LAGUNA_XS_DRAFT, draft_tap_ids=(1, 13, 25, 33, 39),
    ),
    # Qwen/Qwen3.8-27B config.json (text_config): the Qwen3.5-27B text shape (64 layers, 24 q / 4 kv heads of
    # 256, FFN 17408, GDN 16 key / 48 value heads of 128, rope theta 1e7), as baidu-baige/LoongForge#176 and
    # local-inference-lab/vllm#454 quote it. Drafter: DFlash 2 (QWEN38_DRAFT, DFLASH2_SELECTOR).
    "qwen3.8-27b": Shape(
        "qwen3_5_text", 5120, 64, 248320, 24, 4, 256, 17408, 1e7, 248070, draft_layers=5, draft_taps=5,
        block_size=8, extra=QWEN35_27B, draft=QWEN38_DRAFT, draft_tap_ids=(5, 19, 33, 47, 61),
        dflash2=DFLASH2_SELECTOR,
    ),
    # meta-models/Muse-Glimmer-30B (MUSE_GLIMMER): 52 layers, 32 q / 2 kv heads of 128, FFN 19968, vocab 202048;
    # rope theta not stated (the class default, 1e4). Drafter: DFlash 2 (MUSE_GLIMMER_DRAFT, DFLASH2_SELECTOR).
    "muse-glimmer-30b": Shape(
        "muse_glimmer", 6656, 52, 202048, 32, 2, 128, 19968, 1e4, 201818, draft_layers=5, draft_taps=5,
        extra=MUSE_GLIMMER, draft=MUSE_GLIMMER_DRAFT, dflash2=DFLASH2_SELECTOR,
    ),
    "tiny-qwen3": Shape(
        "qwen3", 64, 4, 256, 4, 2, 16, 128, 1e6, 255, draft_layers=2, draft_taps=2, block_size=8
    ),
    "tiny-llama": Shape(
        "llama", 64, 4, 256, 4, 2, 16, 128, 1e4, 255, draft_layers=2, draft_taps=2, block_size=8
    ),
}
# fmt: on


def target_config(s: Shape, max_positions: int = 40960) -> Any:
    """The transformers config of shape `s`: the shared fields, then the family's own (`s.extra` last, so a
    `rope_parameters` there replaces the default single-theta one)."""
    import transformers

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": s.rope_theta}
    if s.model_type in PARTIAL_ROTARY:
        rope["partial_rotary_factor"] = PARTIAL_ROTARY[s.model_type]
    kw: dict[str, Any] = dict(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=rope,
    )
    kw[FFN_KEYS.get(s.model_type, "intermediate_size")] = s.ffn
    kw.update(s.extra)
    kw["max_position_embeddings"] = max(max_positions, s.extra.get("max_position_embeddings", 0))
    if s.model_type in WRAPPED:  # the text shape under the wrapper, the vision tower the class default
        return transformers.AutoConfig.for_model(s.model_type, text_config=kw)
    return transformers.AutoConfig.for_model(s.model_type, **kw)


def shape_target(s: Shape, device: str, dtype: torch.dtype, max_positions: int = 40960) -> Any:
    """A random-weight transformers model of shape `s`, built directly on `device` (no download)."""
    import transformers

    from dflash_zoo.adapters import get_adapter

    adapter = get_adapter(s.model_type)
    cfg = target_config(s, max_positions)
    auto = getattr(transformers, adapter.auto_class)
    kw: dict[str, Any] = {"dtype": dtype}
    impl = adapter.attn_implementation  # gpt-oss: eager (attention sinks)
    if impl:
        kw["attn_implementation"] = impl
    with torch.device(device):
        return auto.from_config(cfg, **kw).eval()


def drafter_config(s: Shape, arch: str | None = None) -> dict[str, Any]:
    """The drafter's config.json dict: the legacy rule (z-lab sizes for the 8B-class hidden sizes) with the
    drafter's own published fields (`s.draft`) on top; a DFlash 2 drafter names its architecture and sizes.
    `arch` builds the same drafter as another architecture ("dflash": without DFlash 2's parts; "dflash2":
    with them, the published sizes where the shape has none; either without the keys of a drafter's own
    architecture, `ARCH_KEYS`), for comparisons at one target shape and block."""
    from dflash_zoo.engine.config import default_target_layer_ids

    if arch is not None:
        s = replace(s, dflash2={} if arch == "dflash" else (s.dflash2 or DFLASH2_SELECTOR))

    cfg = {
        "model_type": "qwen3",
        "hidden_size": s.hidden,
        "intermediate_size": 12288 if s.hidden == 4096 else s.ffn,
        "num_hidden_layers": s.draft_layers,
        "num_attention_heads": 32 if s.hidden >= 2560 else s.heads,
        "num_key_value_heads": 8 if s.hidden >= 2560 else s.kv_heads,
        "head_dim": 128 if s.hidden >= 2560 else s.head_dim,
        "vocab_size": s.vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": 40960,
        "num_target_layers": s.layers,
        "dflash_config": {
            "block_size": s.block_size,
            "target_layer_ids": list(s.draft_tap_ids) or default_target_layer_ids(s.layers, s.draft_taps),
            "mask_token_id": s.mask_token_id,
            **s.dflash2,
        },
    }
    if s.dflash2:
        cfg["architectures"] = ["DFlash2DraftModel"]
    own = {k: v for k, v in s.draft.items() if arch is None or k not in ARCH_KEYS}
    cfg["dflash_config"].update(own.pop("dflash_config", {}))
    return {**cfg, **own}


def shape_drafter(s: Shape, device: str, dtype: torch.dtype, arch: str | None = None) -> Any:
    """A random drafter for shape `s` (DFlash or DFlash 2, as its config names, or as `arch`), on `device`."""
    from dflash_zoo import drafters
    from dflash_zoo.engine.config import normalize_draft_config

    draft = normalize_draft_config(drafter_config(s, arch))
    with torch.device(device):
        return drafters.build(draft).to(dtype).eval()
