"""gpt-oss: alternating sliding(4) / full layers (sliding first), 4 experts top-2, attention sinks.

The window (4) is far smaller than the test prompts and generations, so sliding layers fill up and the
recording crop path is exercised.
"""


def config(common):
    import transformers

    return transformers.GptOssConfig(
        **{**common, "intermediate_size": 64},
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        # the default yarn x32 from 4096 positions; scaled down so the implied factor matches
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    )
