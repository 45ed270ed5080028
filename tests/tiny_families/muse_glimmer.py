"""Muse-Glimmer VLM wrapper (MuseGlimmerForConditionalGeneration): a 4-layer text model [s, s, s, f] with window 4
(the full layer is NoPE, as every 4th layer counted back from the last), normed embeddings, a weightless q/k norm
times `qk_scale_factor`, a sigmoid output gate, sandwich norms, logits times `output_multiplier` before the
tanh soft-cap (20), and a 1-layer vision tower. `output_multiplier` is 1.5 here (the released 0.196 with a tiny
head gives logits near ties); any value other than 1 tests that `logits` applies it.
"""


def text_kwargs(common):
    return dict(**common, sliding_window=4, output_multiplier=1.5, final_logit_softcapping=20.0)


def vision_kwargs():
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        patch_size=4,
        pos_emb_height=8,
        pos_emb_width=8,
    )


def config(common):
    import transformers

    image_token_id = common.pop("image_token_id", 1000)
    text = transformers.MuseGlimmerTextConfig(**text_kwargs(common))
    return transformers.MuseGlimmerConfig(
        text_config=text,
        vision_config=transformers.MuseGlimmerVisionConfig(**vision_kwargs()),
        out_hidden_size=4 * 32,  # the vision width times merge_size**2 (2 x 2 patches merged)
        projector_hidden_size=32,
        tie_word_embeddings=common["tie_word_embeddings"],
        image_token_id=image_token_id,
        video_token_id=1001,
    )
