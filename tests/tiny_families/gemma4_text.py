"""Gemma 4 text-only, shaped like E2B/E4B: 6 layers [s, s, f, s, s, f] with window 4, the last 2 KV-shared,
per-layer inputs of width 8 (transformers needs them once layers share KV), global head dim 32,
final-logit soft-cap 30, sqrt(H)-scaled embeddings.

Untied head so `tests/tiny.py` can scale it; the tied case is covered in tests/test_families.py.
"""

SLIDING, FULL = "sliding_attention", "full_attention"


def text_kwargs(common, per_layer_input=0):
    return dict(
        **{**common, "num_hidden_layers": 6},
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        sliding_window=4,
        global_head_dim=32,
        hidden_size_per_layer_input=per_layer_input,
        vocab_size_per_layer_input=common["vocab_size"],
        final_logit_softcapping=30.0,
    )


def config(common):
    import transformers

    kv_shared = common.pop("num_kv_shared_layers", 2)
    return transformers.Gemma4TextConfig(
        **text_kwargs(common, per_layer_input=8), num_kv_shared_layers=kv_shared
    )
