def config(common):
    import transformers

    return transformers.Qwen3Config(**common)
