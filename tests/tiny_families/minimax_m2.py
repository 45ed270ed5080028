"""MiniMax-M2: partial rotary (half the head) through `rope_parameters.partial_rotary_factor`, q/k RMSNorm
over all heads concatenated, 4 experts top-2.
"""


def config(common):
    import transformers

    rope = {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5}
    return transformers.MiniMaxM2Config(
        **{**common, "intermediate_size": 32},
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters=rope,
    )
