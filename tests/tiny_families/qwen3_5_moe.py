"""Qwen3.5 MoE VLM: the qwen3_5_moe_text tiny decoder plus the qwen3_5 tiny vision tower."""

from tests.tiny_families.qwen3_5 import VISION
from tests.tiny_families.qwen3_5_moe_text import moe_text_kwargs


def config(common):
    import transformers

    return transformers.Qwen3_5MoeConfig(
        text_config=moe_text_kwargs(common),
        vision_config=VISION,
        tie_word_embeddings=common["tie_word_embeddings"],
    )
