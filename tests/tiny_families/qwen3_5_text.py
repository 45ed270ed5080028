"""Qwen3.5 text model: 3 Gated-DeltaNet layers then 1 full-attention layer (docs/families.md)."""

LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)


def text_kwargs(common):
    n = common["num_hidden_layers"]
    return {**common, **LINEAR, "layer_types": (LAYER_TYPES * n)[:n]}


def config(common):
    import transformers

    return transformers.Qwen3_5TextConfig(**text_kwargs(common))
