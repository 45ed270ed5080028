"""Qwen3-VL-MoE wrapper: the qwen3_vl tiny config with a 4-expert (top-2) text model."""

from tests.tiny_families.qwen3_vl import ROPE, vision_config


def config(common):
    import transformers

    image_token_id = common.pop("image_token_id", 1000)
    text = transformers.Qwen3VLMoeTextConfig(
        **common, rope_parameters=ROPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )
    return transformers.Qwen3VLMoeConfig(
        text_config=text,
        vision_config=transformers.Qwen3VLMoeVisionConfig(**vision_config(common)),
        tie_word_embeddings=common["tie_word_embeddings"],
        image_token_id=image_token_id,
        video_token_id=1001,
        vision_start_token_id=1002,
        vision_end_token_id=1003,
    )
