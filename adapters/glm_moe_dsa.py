"""GLM-5 / GLM-5.1 targets (zai-org/GLM-5.1, zai-org/GLM-5.1-FP8: GlmMoeDsaForCausalLM; mirrors transformers
`models/glm_moe_dsa/modeling_glm_moe_dsa.py`).

Quirks:
- MLA as DeepSeek-V3 (q LoRA 2048, kv LoRA 512, 64 of 256 q/k dims rotary, laid out as interleaved pairs) plus
  DeepSeek sparse attention (DSA): a lightweight indexer scores every cached key per query (ReLU of q.k per
  indexer head, weighted and summed) and each query attends only to its top `index_topk` (2048) keys; layers
  marked "shared" in `indexer_types` reuse the previous layer's selection. Decoder layers return
  (states, top-k indices): a tap takes the states;
- the cache holds one `DynamicIndexedLayer` per layer: the attention K/V (5.25: the compressed latents; 5.17: the
  expanded K/V) plus the indexer's keys. Its negative `crop` trims both, and the indexer's causal mask makes a
  query's selection independent of later rows, so crop is an exact rollback (base class); measured to 1e-6 on
  fp32 logits with tests/test_families.py;
- top-k is discontinuous: two keys with exactly equal index scores (ReLU zeros in every indexer head) are
  ordered by `torch.topk` differently for rows of different lengths, so a verify block and one-token decoding
  can pick different keys. With 32 indexer heads that needs 32 simultaneous zeros; the tiny test model uses 16
  heads for the same reason (4 heads tie often enough to change its greedy output);
- MoE after `first_k_dense_replace` dense layers: sigmoid routing with a score-correction bias, grouped top-k,
  `routed_scaling_factor`, plus shared experts; none of it changes what a tap sees;
- GLM-5.1-FP8 is an official FP8 checkpoint (block-scaled weights, `quantization_config`): it loads through
  transformers' own FP8 support, on a GPU that has it;
- no static layout: MLA and the DSA indexer are beyond the fast engine's attention (the eager loop runs it).
"""

from __future__ import annotations

from typing import Any

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import Problem, TargetAdapter

# the layer type transformers gives every DSA layer: 5.17 spells it "deepseek_sparse_attention", 5.25 "indexed_attention"
DSA_LAYER_TYPES = {"indexed_attention", "deepseek_sparse_attention"}


@register("glm_moe_dsa")
class GlmMoeDsaAdapter(TargetAdapter):
    @classmethod
    def validate(cls, target_config: dict[str, Any], draft: Any) -> list[Problem]:
        problems = super().validate(target_config, draft)
        unknown = sorted(set(target_config.get("layer_types") or []) - DSA_LAYER_TYPES)
        if unknown:  # a layer kind whose cache rollback has not been checked
            problems.append(Problem("FAIL", "layer_types", f"layer types {unknown} have no checked rollback"))
        return problems
