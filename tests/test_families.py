"""Family specifics the adapter matrix does not see: Gemma's soft-cap (also on draft logits), scaled
embeddings and tied head, KV-shared taps, sliding windows overrun by a generation, harmony stop ids,
Kimi's forced untied head, MiniMax's legacy `rotary_dim`, Qwen3-VL's mRoPE state, unsupported types;
Muse-Glimmer's normed embeddings and scaled soft-capped logits (with a DFlash 2 drafter), GLM-5's sparse
attention (indexer keys cropped with the KV), Gemma 4 unified's KV-shared taps."""

from __future__ import annotations

import json
import random

import pytest
import torch
from dflash_zoo.adapters import find_adapter, get_adapter

from dflash_zoo import compat
from dflash_zoo.engine.decode import SpeculativeDecoder
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.errors import UnsupportedModelError
from tests.oracles import greedy_reference
from tests.tiny import VOCAB, tiny_drafter, tiny_target


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB - 2) for _ in range(n)]


@pytest.fixture(scope="module")
def gemma():
    model = tiny_target("gemma4_text", seed=0)
    return model, get_adapter("gemma4_text")(model)


def test_gemma_logits_are_soft_capped(gemma):
    model, adapter = gemma
    h = torch.randn(1, 5, model.config.hidden_size) * 1000  # raw logits far beyond the cap
    with torch.no_grad():
        raw = model.get_output_embeddings()(h)
        capped = adapter.logits(h)
    assert raw.abs().max() > 100 and capped.abs().max() <= 30.0
    torch.testing.assert_close(capped, 30.0 * torch.tanh(raw / 30.0))


def test_gemma_draft_logits_go_through_the_drafter_soft_cap(gemma):
    """Draft logits are the target's bare head (`adapter.head`) capped by the drafter's own
    `final_logit_softcapping` (30 in the z-lab Gemma 4 drafter configs)."""
    model, adapter = gemma
    drafter = tiny_drafter(model, seed=3, block_size=4, final_logit_softcapping=30.0)
    seen = []
    head, draft_logits = adapter.head, drafter.draft_logits

    def big_head(h):
        return head(h * 1000)  # blow drafts past the cap: only the soft-cap keeps them bounded

    def spy(h, head_fn):
        out = draft_logits(h, head_fn)
        seen.append(out.abs().max().item())
        return out

    adapter.head, drafter.draft_logits = big_head, spy  # instance attributes: the engine must use both
    try:
        dec = SpeculativeDecoder(
            adapter, drafter, _prompt(0, 6), GenerationConfig(max_new_tokens=6, block_size=4), 255
        )
        list(dec)
    finally:
        del adapter.head, drafter.draft_logits
    assert seen and max(seen) <= 30.0


def test_gemma_embed_includes_sqrt_hidden_scale(gemma):
    model, adapter = gemma
    ids = torch.tensor([_prompt(1, 7)])
    scale = model.config.hidden_size**0.5
    with torch.no_grad():
        torch.testing.assert_close(adapter.embed(ids), model.model.embed_tokens.weight[ids] * scale)


def test_gemma_tied_head():
    model = tiny_target("gemma4", seed=0, lm_scale=1.0, tie_word_embeddings=True)
    adapter = get_adapter("gemma4")(model)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.tensor([_prompt(2, 9)])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(adapter.logits(out.hidden_states[-1]), out.logits, rtol=0, atol=1e-5)


def test_gemma_kv_shared_layers_keep_every_prefill_position(gemma):
    model, adapter = gemma
    shared = list(
        range(model.config.num_hidden_layers - model.config.num_kv_shared_layers, adapter.num_layers)
    )
    ids = torch.tensor([_prompt(3, 11)])
    with torch.no_grad(), adapter.tap([0, *shared]) as rec:
        logits = adapter.forward(ids, adapter.new_cache(), logits_to_keep=1)
        feats = rec.take()
    assert logits.shape[1] == 1 and feats.shape == (1, 11, (1 + len(shared)) * model.config.hidden_size)


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4", "gemma4_unified", "muse_glimmer"])
def test_rollback_past_the_sliding_window_is_exact_in_fp64(model_type):
    """fp64 separates rollback bugs from fp32 kernel noise (about 1e-5 on tiny Gemma logits; gpt-oss
    and Laguna experts have no fp64 kernel and their fp32 noise stays under the matrix tolerance)."""
    model = tiny_target(model_type, seed=0).double()
    adapter = get_adapter(model_type)(model)
    assert model.config.get_text_config().sliding_window < 12
    prompt, kept = _prompt(4, 12), []
    with torch.no_grad():
        cache = adapter.new_cache()
        adapter.forward(torch.tensor([prompt]), cache)
        adapter.start_decoding(cache)
        for step, keep in enumerate([3, 8, 1, 5]):
            block = _prompt(10 + step, 8)
            adapter.forward(torch.tensor([block]), cache)
            adapter.rollback(cache, 8 - keep, None, torch.tensor([block[:keep]]))
            kept += block[:keep]
        got = adapter.forward(torch.tensor([[7]]), cache)[0, -1]
        clean = compat.forward(model, torch.tensor([prompt + kept + [7]]), compat.new_cache(model.config))[
            0, -1
        ]
    assert (got - clean).abs().max().item() < 1e-10


@pytest.mark.parametrize("model_type", ["gpt_oss", "muse_glimmer", "laguna", "gemma4_unified"])
def test_long_generation_past_the_window_stays_lossless(model_type):
    model = tiny_target(model_type, seed=1)
    adapter, drafter = get_adapter(model_type)(model), tiny_drafter(model, seed=2, block_size=6)
    prompt = _prompt(5, 9)
    dec = SpeculativeDecoder(adapter, drafter, prompt, GenerationConfig(max_new_tokens=48, block_size=6), 255)
    list(dec)
    assert dec.result.output_ids == greedy_reference(model, prompt, 48)


def test_harmony_stop_ids():
    ids = get_adapter("gpt_oss").extra_stop_token_ids
    assert {200002, 200012, 199999} <= set(ids)


def test_unsupported_model_type_names_the_nearest():
    with pytest.raises(UnsupportedModelError) as err:
        get_adapter("gemma4_txt")
    assert "gemma4_text" in err.value.hint
    # Gemma 4 12B's own model type (encoder-free wrapper), no longer taken for an alias of gemma4
    assert find_adapter("gemma4_unified") is not get_adapter("gemma4")


def test_kimi_head_is_forced_untied(tmp_path):
    model = tiny_target("kimi_k25", seed=0)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True  # Kimi_K25Config's default; the checkpoint still has its own head
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = get_adapter("kimi_k25").load_model(str(tmp_path), torch.float32, "cpu")
    assert loaded.get_output_embeddings().weight is not loaded.get_input_embeddings().weight
    torch.testing.assert_close(loaded.get_output_embeddings().weight, model.get_output_embeddings().weight)


def test_minimax_legacy_rotary_dim_becomes_partial_factor(tmp_path):
    from dflash_zoo.adapters.minimax_m2 import fix_partial_rotary

    model = tiny_target("minimax_m2", seed=0)
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 5000000.0}
    model.config.rotary_dim = 8  # half of head_dim 16, as released checkpoints state it
    assert fix_partial_rotary(model.config).rope_parameters["partial_rotary_factor"] == 0.5


def test_qwen3_vl_new_cache_clears_stale_rope_deltas():
    model = tiny_target("qwen3_vl", seed=0)
    adapter = get_adapter("qwen3_vl")(model)
    model.model.rope_deltas = torch.tensor([[5]])  # left over from an earlier image prompt
    adapter.new_cache()
    assert model.model.rope_deltas is None


# ---- Muse-Glimmer: normed embeddings, logits x output_multiplier then soft-cap; DFlash 2 drafter ----------


@pytest.fixture(scope="module")
def glimmer():
    model = tiny_target("muse_glimmer", seed=0)
    return model, get_adapter("muse_glimmer")(model)


def test_glimmer_embed_is_normed_and_embed_rows_are_raw(glimmer):
    model, adapter = glimmer
    ids = torch.tensor([_prompt(6, 9)])
    rows = model.get_input_embeddings().weight[ids]  # [1, 9, H]
    with torch.no_grad():
        torch.testing.assert_close(adapter.embed_rows(ids), rows)
        normed = adapter.embed(ids)
    eps = model.config.get_text_config().rms_norm_eps
    torch.testing.assert_close(
        normed, rows * (rows.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    )  # weightless
    assert not torch.allclose(normed, rows)


def test_glimmer_logits_scale_then_soft_cap(glimmer):
    model, adapter = glimmer
    text = model.config.get_text_config()
    h = torch.randn(1, 5, text.hidden_size) * 1000  # raw logits far beyond the cap
    with torch.no_grad():
        raw = model.get_output_embeddings()(h)
        torch.testing.assert_close(adapter.head(h), raw)  # the drafter's head: bare
        capped = adapter.logits(h)
    cap, mult = text.final_logit_softcapping, text.output_multiplier
    assert mult != 1.0 and raw.abs().max() > 100 and capped.abs().max() <= cap
    torch.testing.assert_close(capped, cap * torch.tanh(raw * mult / cap))


def test_glimmer_dflash2_pair_is_lossless(glimmer):
    """The published pairing: a DFlash 2 drafter embedding raw rows times its `input_embedding_scale` and scaling
    and capping the bare head as the target does; greedy output is the target's own."""
    from tests.tiny import tiny_dflash2

    model, adapter = glimmer
    text = model.config.get_text_config()
    extra = dict(
        output_multiplier=text.output_multiplier,
        final_logit_softcapping=text.final_logit_softcapping,
        input_embedding_scale=2.0,
    )
    drafter = tiny_dflash2(model, seed=4, block_size=6, **extra)
    assert (
        drafter.cfg.input_embedding_scale == 2.0 and drafter.cfg.output_multiplier == text.output_multiplier
    )
    for seed, n in ((0, 30), (1, 9)):
        prompt = _prompt(20 + seed, 7)
        dec = SpeculativeDecoder(
            adapter, drafter, prompt, GenerationConfig(max_new_tokens=n, block_size=6), 255
        )
        list(dec)
        assert dec.result.output_ids == greedy_reference(model, prompt, n)


def test_glimmer_validate_flags_a_drafter_scaled_unlike_the_target():
    from dflash_zoo.engine.config import normalize_draft_config
    from tests.tiny import draft_config_dict

    cls = get_adapter("muse_glimmer")
    target = {"model_type": "muse_glimmer", "text_config": {"hidden_size": 64, "num_hidden_layers": 4,
              "vocab_size": VOCAB, "final_logit_softcapping": 20.0, "output_multiplier": 0.25}}  # fmt: skip
    same = normalize_draft_config(draft_config_dict(final_logit_softcapping=20.0, output_multiplier=0.25))
    assert not [p for p in cls.validate(target, same) if p.code in ("softcap", "output_multiplier")]
    bare = normalize_draft_config(draft_config_dict())
    assert {p.code for p in cls.validate(target, bare) if p.severity == "WARN"} >= {
        "softcap",
        "output_multiplier",
    }
    assert [p.code for p in cls.validate({"model_type": "muse_glimmer"}, bare)] == ["text_config"]


# ---- GLM-5 (DSA): the indexer's keys are cropped with the attention K/V ----------------------------------


def test_dsa_sparse_attention_is_active_in_the_tiny_model():
    """The tiny model keeps 4 keys per query: a prompt of 20 attends sparsely (a dense top-k changes the logits),
    so the matrix's token-for-token checks cover the indexer."""
    model = tiny_target("glm_moe_dsa", seed=0)
    ids = torch.tensor([_prompt(7, 20)])
    with torch.no_grad():
        sparse = model(ids).logits
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = 64
        dense = model(ids).logits
    assert model.config.index_topk == 4 and not torch.allclose(sparse, dense, atol=1e-3)


def test_dsa_rollback_trims_the_indexer_keys():
    model = tiny_target("glm_moe_dsa", seed=0)
    adapter = get_adapter("glm_moe_dsa")(model)
    prompt, block = _prompt(8, 13), _prompt(9, 8)
    with torch.no_grad():
        cache = adapter.new_cache()
        adapter.forward(torch.tensor([prompt]), cache)
        adapter.start_decoding(cache)
        adapter.forward(torch.tensor([block]), cache)
        adapter.rollback(cache, 5, adapter.snapshot(cache), torch.tensor([block[:3]]))
    full = [layer for layer in cache.layers if getattr(layer, "indexer_keys", None) is not None]
    assert full and all(layer.indexer_keys.shape[1] == 16 for layer in full)
    assert cache.get_seq_length() == 16


def test_dsa_validate_refuses_unchecked_layer_types():
    from dflash_zoo.engine.config import normalize_draft_config
    from tests.tiny import draft_config_dict

    cls, draft = get_adapter("glm_moe_dsa"), normalize_draft_config(draft_config_dict())
    base = {"model_type": "glm_moe_dsa", "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": VOCAB}
    for kind in ("indexed_attention", "deepseek_sparse_attention"):  # 5.25's and 5.17's spelling
        assert not [
            p for p in cls.validate({**base, "layer_types": [kind] * 4}, draft) if p.severity == "FAIL"
        ]
    bad = cls.validate({**base, "layer_types": ["linear_attention"] * 4}, draft)
    assert [p.code for p in bad if p.severity == "FAIL"] == ["layer_types"]


# ---- Gemma 4 unified (Gemma 4 12B) ---------------------------------------------------------------------------


def test_gemma4_unified_scaled_embed_and_kv_shared_taps():
    model = tiny_target("gemma4_unified", seed=0)
    adapter = get_adapter("gemma4_unified")(model)
    text = model.config.get_text_config()
    ids = torch.tensor([_prompt(10, 11)])
    shared = list(range(text.num_hidden_layers - text.num_kv_shared_layers, adapter.num_layers))
    with torch.no_grad():
        rows = model.get_input_embeddings().weight[ids]
        torch.testing.assert_close(adapter.embed(ids), rows * text.hidden_size**0.5)
        with adapter.tap([0, *shared]) as rec:
            logits = adapter.forward(ids, adapter.new_cache(), logits_to_keep=1)
            feats = rec.take()
    assert shared and logits.shape[1] == 1 and feats.shape == (1, 11, (1 + len(shared)) * text.hidden_size)
