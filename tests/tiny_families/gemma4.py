"""Gemma 4 VLM wrapper (Gemma4ForConditionalGeneration): the gemma4_text decoder without KV sharing (as the
31B / 26B-A4B targets) and a 1-layer vision tower. Multimodal token ids sit outside the prompt range; tests
that feed an image pass `image_token_id` (popped here) to place the image token inside the vocabulary.
"""

from tests.tiny_families.gemma4_text import text_kwargs


def vision_kwargs():
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )


def config(common):
    import transformers

    image_token_id = common.pop("image_token_id", 1000)
    text = transformers.Gemma4TextConfig(**text_kwargs(common), num_kv_shared_layers=0)
    return transformers.Gemma4Config(
        text_config=text,
        vision_config=transformers.Gemma4VisionConfig(**vision_kwargs()),
        audio_config=None,
        tie_word_embeddings=common["tie_word_embeddings"],
        image_token_id=image_token_id,
        boi_token_id=1001,
        eoi_token_id=1002,
        video_token_id=1003,
        boa_token_id=1004,
        eoa_token_index=1005,
        audio_token_id=1006,
    )
