"""Laguna (LagunaForCausalLM): layers [s, f, s, f] with window 4, per-layer query-head counts (4, 8, 4, 8), q/k
RMSNorms per head, a softplus output gate per head, rotary tables per layer type (full layers rotate half the
head), 1 dense layer then MoE layers of 4 experts (top 2, sigmoid routing with a score-correction bias) plus an
ungated shared expert and a routed scaling factor.
"""

SLIDING, FULL = "sliding_attention", "full_attention"


def config(common):
    import transformers

    return transformers.LagunaConfig(
        **common,
        layer_types=[SLIDING, FULL, SLIDING, FULL],
        sliding_window=4,
        num_attention_heads_per_layer=[4, 8, 4, 8],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        moe_routed_scaling_factor=2.0,
    )
