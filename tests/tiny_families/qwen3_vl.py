"""Qwen3-VL wrapper (Qwen3VLForConditionalGeneration): a qwen3-like text model with interleaved mRoPE
(sections [4, 2, 2] of the 8 rotary pairs) and a 1-layer vision tower with one deepstack merger.
Tests that feed an image pass `image_token_id` (popped here) to place the image token inside the vocabulary.
"""

ROPE = {
    "rope_type": "default",
    "rope_theta": 5000000.0,
    "mrope_section": [4, 2, 2],
    "mrope_interleaved": True,
}


def vision_config(common):
    return dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=common["hidden_size"],
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )


def config(common):
    import transformers

    image_token_id = common.pop("image_token_id", 1000)
    return transformers.Qwen3VLConfig(
        text_config=transformers.Qwen3VLTextConfig(**common, rope_parameters=ROPE),
        vision_config=transformers.Qwen3VLVisionConfig(**vision_config(common)),
        tie_word_embeddings=common["tie_word_embeddings"],
        image_token_id=image_token_id,
        video_token_id=1001,
        vision_start_token_id=1002,
        vision_end_token_id=1003,
    )
