"""GLM-5 / GLM-5.1 (GlmMoeDsaForCausalLM): MLA (q/kv LoRA ranks, 16 of 32 q/k dims rotary, interleaved) with a
DeepSeek sparse-attention indexer keeping the top 4 keys per query (so prompts longer than 4 really attend
sparsely), layers 1 and 3 reusing the previous layer's top-k ("shared"), 1 dense layer then MoE layers of 4
routed experts (top 2, sigmoid routing with a score-correction bias) plus 1 shared expert.
"""


def config(common):
    import transformers

    return transformers.GlmMoeDsaConfig(
        **{**common, "num_key_value_heads": common["num_attention_heads"]},
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=common["head_dim"],
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        index_topk=4,
        index_head_dim=32,
        index_n_heads=16,
        indexer_types=["full", "shared", "full", "shared"],
    )
