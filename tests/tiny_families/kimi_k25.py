"""Kimi-K2.5 VLM wrapper (Kimi_K25ForConditionalGeneration) around a tiny deepseek_v3 decoder and a 1-layer
vision tower. The wrapper's `tie_word_embeddings` defaults to True; set False as the real checkpoint is.
"""

from tests.tiny_families.deepseek_v3 import text_kwargs


def config(common):
    import transformers

    image_token_id = common.pop("image_token_id", 1000)
    text = transformers.DeepseekV3Config(**text_kwargs(common))
    vision = transformers.Kimi_K25VisionConfig(
        patch_size=4,
        pos_emb_height=8,
        pos_emb_width=8,
        num_attention_heads=2,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
    )
    return transformers.Kimi_K25Config(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=32,
        tie_word_embeddings=common["tie_word_embeddings"],
        image_token_id=image_token_id,
        video_token_id=1001,
        vision_start_token_id=1002,
        vision_end_token_id=1003,
    )
