"""Gemma 4 unified (Gemma4UnifiedForConditionalGeneration, Gemma 4 12B): the gemma4_text tiny layout without
per-layer inputs (6 layers [s, s, f, s, s, f], window 4, the last 2 KV-shared, global head dim 32, soft-cap 30,
sqrt(H)-scaled embeddings) and the encoder-free vision embedder (patches projected straight into the text
width); no audio embedder.
"""

from tests.tiny_families.gemma4_text import text_kwargs


def config(common):
    import transformers

    image_token_id = common.pop("image_token_id", 1000)
    kv_shared = common.pop("num_kv_shared_layers", 2)
    text = {
        k: v for k, v in text_kwargs(common).items() if not k.endswith("per_layer_input")
    }  # no per-layer inputs in this family
    return transformers.Gemma4UnifiedConfig(
        text_config=transformers.Gemma4UnifiedTextConfig(**text, num_kv_shared_layers=kv_shared),
        vision_config=transformers.Gemma4UnifiedVisionConfig(
            patch_size=4, pooling_kernel_size=2, mm_embed_dim=32, mm_posemb_size=16, output_proj_dims=64
        ),
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
