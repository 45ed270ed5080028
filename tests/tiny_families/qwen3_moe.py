def config(common):
    import transformers

    return transformers.Qwen3MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **common
    )
