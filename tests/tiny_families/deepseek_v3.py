"""DeepSeek-V3 (the Kimi-K2.5 text model): MLA with q/kv LoRA ranks, 1 dense layer then MoE layers with
4 routed experts (top-2, 1 group) and 1 shared expert. Strict config: `head_dim == qk_rope_head_dim`.
"""


def text_kwargs(common):
    return dict(
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
    )


def config(common):
    import transformers

    return transformers.DeepseekV3Config(**text_kwargs(common))
