"""Qwen3 mixture-of-experts targets (Qwen/Qwen3-Coder-30B-A3B-Instruct; transformers `models/qwen3_moe`).

Quirks:
- same decoder layout and cache as dense Qwen3 (full attention, negative crop is exact);
- the sparse MoE block does not change what a tap sees: decoder layers still return the residual stream;
- Qwen3-Coder has no thinking mode, so no template switch is passed;
- fast path: attention as dense Qwen3 (q/k norms); the sparse MoE block runs as HF's own module inside the
  static step, with transformers' default experts implementation `grouped_mm` (or `batched_mm`): no host sync,
  so the step can be captured. The `eager` implementation (a Python loop over the hit experts) cannot.
  Its router softmaxes every expert's logit in fp32, takes the top k and renormalises them where
  `norm_topk_prob`; the experts' gate/up output is [gate | up] with SiLU (both declared for the fused kernels).
"""

from __future__ import annotations

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import SparseMoE, StaticAttention, StaticLayout, TargetAdapter


@register("qwen3_moe")
class Qwen3MoeAdapter(TargetAdapter):
    # dense layers (`mlp_only_layers`, `decoder_sparse_step`) run as Qwen3's; sparse ones as their module
    static_layout = StaticLayout(
        attention=StaticAttention(q_norm="q_norm", k_norm="k_norm"),
        moe=SparseMoE(routing="softmax_topk", renormalize="norm_topk_prob", expert_gate="silu"),
        cuda_verified=True,
    )
