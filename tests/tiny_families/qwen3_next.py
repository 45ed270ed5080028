"""Qwen3-Next (Coder-Next): the qwen3_5_text hybrid layout with sparse MoE MLPs on every layer."""

from tests.tiny_families.qwen3_5_moe_text import MOE
from tests.tiny_families.qwen3_5_text import text_kwargs


def config(common):
    import transformers

    return transformers.Qwen3NextConfig(
        **text_kwargs(common), **MOE, decoder_sparse_step=1, mlp_only_layers=[]
    )
