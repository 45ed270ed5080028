"""Family specifics the adapter matrix does not see: Gemma's soft-cap (also on draft logits), scaled
embeddings and tied head, KV-shared taps, sliding windows overrun by a generation, harmony stop ids,
Kimi's forced untied head, MiniMax's legacy `rotary_dim`, Qwen3-VL's mRoPE state, unsupported types."""

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


def test_gemma_draft_logits_go_through_the_soft_cap(gemma):
    model, adapter = gemma
    drafter = tiny_drafter(model, seed=3, block_size=4)
    seen = []
    original = adapter.logits

    def spy(h):
        out = original(h * 1000)  # blow drafts past the cap: only the soft-cap keeps them bounded
        seen.append(out.abs().max().item())
        return out

    adapter.logits = spy  # instance attribute on a test adapter: the engine must call adapter.logits
    try:
        dec = SpeculativeDecoder(
            adapter, drafter, _prompt(0, 6), GenerationConfig(max_new_tokens=6, block_size=4), 255
        )
        list(dec)
    finally:
        del adapter.logits
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


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4"])
def test_rollback_past_the_sliding_window_is_exact_in_fp64(model_type):
    """fp64 separates rollback bugs from fp32 kernel noise (about 1e-5 on tiny Gemma logits; gpt-oss
    experts have no fp64 kernel and its fp32 noise stays under the matrix tolerance)."""
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


def test_long_generation_past_the_window_stays_lossless():
    model = tiny_target("gpt_oss", seed=1)
    adapter, drafter = get_adapter("gpt_oss")(model), tiny_drafter(model, seed=2, block_size=6)
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
    assert find_adapter("gemma4_unified") is get_adapter("gemma4")


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
