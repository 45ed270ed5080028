"""Qwen3.5 MoE text decoder: the qwen3_5_text layout with 4 experts, top-2, plus a shared expert."""

from tests.tiny_families.qwen3_5_text import text_kwargs

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def moe_text_kwargs(common):
    kw = {
        k: v for k, v in text_kwargs(common).items() if k != "intermediate_size"
    }  # not a field of this class
    return {**kw, **MOE}


def config(common):
    import transformers

    return transformers.Qwen3_5MoeTextConfig(**moe_text_kwargs(common))
