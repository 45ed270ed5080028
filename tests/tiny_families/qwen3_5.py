"""Qwen3.5 VLM: the qwen3_5_text tiny decoder plus a one-block vision tower (docs/families.md)."""

from tests.tiny_families.qwen3_5_text import text_kwargs

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def config(common):
    import transformers

    return transformers.Qwen3_5Config(
        text_config=text_kwargs(common),
        vision_config=VISION,
        tie_word_embeddings=common["tie_word_embeddings"],
    )
