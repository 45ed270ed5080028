"""The static engine's layer kinds beyond plain full attention, against transformers' own modules (fp32, CPU).

- Gated-DeltaNet layers (cuda/static/gdn.py): a verify followed by `commit(n)` must leave the conv window and the
  recurrent state where n one-row steps would have, for every n, and the one-row steps must match
  transformers' cached decode of the same module;
- sliding windows and sinks (gpt-oss): generations run well past the window, and a window or sinks left out
  of the static forward changes the logits (so the token-for-token matrix really tests them).
The engine-level comparisons (static == eager == greedy, forced partial accepts) run for these families in the
matrix of tests/test_fast.py and tests/test_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from dflash_zoo.cuda.static.gdn import StaticGDN
from dflash_zoo.engine.results import GenerationConfig
from tests.oracles import greedy_reference
from tests.static_matrix import STATIC_MODEL_TYPES, fast_engine, static_pair
from tests.tiny import VOCAB

MASK = VOCAB - 1
HYBRID = [t for t in STATIC_MODEL_TYPES if t.startswith(("qwen3_5", "qwen3_next"))]


def test_the_hybrid_and_sliding_families_are_in_the_matrix():
    assert {"qwen3_5_text", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss"} <= set(STATIC_MODEL_TYPES)


def _gdn_layer(model_type: str) -> tuple[StaticGDN, torch.nn.Module, int]:
    adapter, drafter = static_pair(model_type)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    i = next(i for i, g in enumerate(eng.target.gdn) if g is not None)
    return eng.target.gdn[i], adapter.layers()[i], adapter.text_config.hidden_size


@pytest.mark.parametrize("model_type", HYBRID)
@pytest.mark.parametrize("n", [1, 3, 5, 8])
@pytest.mark.parametrize("recurrent", [False, True], ids=["closed-form", "recurrent"])
def test_gdn_commit_equals_stepping_the_accepted_rows(model_type, n, recurrent):
    """Both commit rules (the closed-form solve, and the recurrent rule over the block with the rows past n made
    identity steps, which flash-linear-attention runs as one kernel) leave the states n single steps leave."""
    gdn, _, hidden = _gdn_layer(model_type)
    gdn.recurrent_commit = recurrent
    gen = torch.Generator().manual_seed(n)
    prompt, block = (torch.randn(1, t, hidden, generator=gen) for t in (11, 8))
    with torch.inference_mode():
        gdn(prompt, "prefill")
        before = [s.clone() for s in gdn.states()]
        verify_out = gdn(block, "verify")
        assert all(torch.equal(a, b) for a, b in zip(before, gdn.states(), strict=True))  # verify keeps them
        gdn.commit(torch.tensor(n))
        committed = [s.clone() for s in gdn.states()]
        for s, b in zip(gdn.states(), before, strict=True):
            s.copy_(b)
        step_out = torch.cat([gdn(block[:, j : j + 1], "step") for j in range(n)], dim=1)
    torch.testing.assert_close(verify_out[:, :n], step_out, rtol=1e-4, atol=1e-5)
    window, state = committed
    torch.testing.assert_close(
        window, gdn.window, rtol=1e-5, atol=1e-6
    )  # the same inputs (one-row GEMMs round apart)
    torch.testing.assert_close(state, gdn.state, rtol=1e-4, atol=1e-5)
    if n < 8:  # the rows past n really were left out (a commit of the whole block differs)
        for s, b in zip(gdn.states(), before, strict=True):
            s.copy_(b)
        with torch.inference_mode():
            gdn(block, "verify")
            gdn.commit(torch.tensor(8))
        assert not torch.allclose(gdn.state, state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", HYBRID)
def test_gdn_prefill_and_steps_match_the_module(model_type):
    """Prefill then one-row steps through `StaticGDN` give the outputs of the HF module over the whole
    sequence at once (no cache: causal conv and the chunked rule from a zero state)."""
    gdn, layer, hidden = _gdn_layer(model_type)
    x = torch.randn(1, 14, hidden, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = gdn.gdn(x)
        got = torch.cat(
            [gdn(x[:, :10], "prefill")] + [gdn(x[:, j : j + 1], "step") for j in range(10, 14)], 1
        )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_gpt_oss_generation_runs_past_the_window_with_sinks():
    adapter, drafter = static_pair("gpt_oss")
    text = adapter.text_config
    prompt, new = list(range(3, 15)), 24
    assert text.sliding_window < len(prompt) < len(prompt) + new  # the window fills up early
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    sinks = [m.sinks for m in eng.target.layers]
    assert all(s is not None and s.abs().sum() > 0 for s in sinks)
    assert [m.window for m in eng.target.layers] == [text.sliding_window if t == "sliding_attention" else None
                                                     for t in text.layer_types]  # fmt: skip
    cfg = GenerationConfig(max_new_tokens=new)
    ref = greedy_reference(adapter.model, prompt, new)
    assert eng.speculative(prompt, cfg).output_ids == eng.autoregressive(prompt, cfg).output_ids == ref


@pytest.mark.parametrize("drop", ["window", "sinks"])
def test_gpt_oss_window_and_sinks_change_the_logits(drop):
    """Without its window or its sinks the static forward no longer matches transformers (fp32)."""
    adapter, drafter = static_pair("gpt_oss")
    ids = torch.tensor([list(range(3, 23))])
    with torch.inference_mode():
        want = adapter.model(ids).logits
        eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
        pos = torch.zeros((), dtype=torch.long)
        got = eng.target.forward(ids, pos, prefill=True)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        eng.target.layers = [m._replace(**{drop: None}) for m in eng.target.layers]
        eng.target.kv.masked_prefill = True  # keep the masked path: only the dropped feature differs
        off = eng.target.forward(ids, pos, prefill=True)
    assert not torch.allclose(off, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_verify_commit_verify_logits_equal_transformers(model_type):
    """Logits, not tokens (a tiny target may repeat one token): prefill, verify a block, commit part of it
    (1, 3 or all 8 rows), verify again past the window, against transformers' forward on the committed ids."""
    adapter, drafter = static_pair(model_type)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    t = eng.target
    gen = torch.Generator().manual_seed(7)
    prompt, *blocks = (torch.randint(0, MASK, (1, n), generator=gen) for n in (10, 8, 8, 8))
    kept = [prompt]
    with torch.inference_mode():
        pos = torch.zeros((), dtype=torch.long)
        t.forward(prompt, pos, prefill=True)
        pos = pos + prompt.shape[1]
        for block, n in zip(blocks, (3, 1, 8), strict=True):
            got = t.forward(block, pos)[0]  # [8, V]
            want = adapter.model(torch.cat([*kept, block], 1)).logits[0, -8:]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            t.commit(torch.tensor(n))
            pos, kept = pos + n, [*kept, block[:, :n]]


GEMMA_VARIANTS = {  # the 31B / 26B-A4B layouts on the tiny Gemma 4 VLM (no KV sharing, no per-layer input)
    "k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "moe_branch": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
}


KERNELS = dict(decode_attention="split", block_attention="split", gemv=True, fused_ops=True, moe_rows=16)


@pytest.mark.parametrize(
    "kernels", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["torch", "kernels"]
)
@pytest.mark.parametrize("variant", sorted(GEMMA_VARIANTS))
def test_gemma4_31b_and_26b_layouts(variant, kernels):
    """K = V global layers with their own KV heads, and the experts beside the dense MLP: the static forward's
    logits through verify / commit / verify equal transformers', and the layout resolved what it should; with
    the Triton kernels (under the interpreter on CPU, ~70 s each) every attention layer takes the rotary + K/V
    kernel and every layer's residual adds the sandwich kernel."""
    if kernels:
        pytest.importorskip("triton")
    adapter, drafter = static_pair("gemma4", **GEMMA_VARIANTS[variant])
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, **(KERNELS if kernels else {}))
    layers = eng.target.layers
    assert all(eng.target.rope_kernel) == kernels
    assert all(eng.target.sandwich) == kernels  # each residual add with its norms in one kernel (sandwich.py)
    if variant == "k_eq_v":
        full = [i for i, m in enumerate(layers) if m.kind == "full_attention"]
        assert full and all(layers[i].v is None and eng.target.kv.k[i].shape[1] == 1 for i in full)
    else:
        assert all(m.moe_branch is not None for m in layers)
    gen = torch.Generator().manual_seed(3)
    prompt, block, block2 = (torch.randint(0, MASK, (1, n), generator=gen) for n in (10, 8, 8))
    with torch.inference_mode():
        pos = torch.zeros((), dtype=torch.long)
        eng.target.forward(prompt, pos, prefill=True)
        got = eng.target.forward(block, pos + 10)[0]
        torch.testing.assert_close(
            got, adapter.model(torch.cat([prompt, block], 1)).logits[0, -8:], rtol=1e-4, atol=1e-4
        )
        eng.target.commit(torch.tensor(2))
        got = eng.target.forward(block2, pos + 12)[0]
        want = adapter.model(torch.cat([prompt, block[:, :2], block2], 1)).logits[0, -8:]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cfg = GenerationConfig(max_new_tokens=16)
    assert eng.speculative(list(range(3, 15)), cfg).output_ids == greedy_reference(
        adapter.model, list(range(3, 15)), 16
    )


# families whose own attention layers stay off the rotary + K/V kernel, and why (`qkv.rope_kernel`)
NO_ROPE_KERNEL = {"minimax_m2": "its q/k norms span all heads at once, not one head"}
# the dense MLPs' activation in the GEMV (`gemv.ACTS`; 0: no dense MLP, or not one of the kernels')
GATE_ACT = {"gemma4": 3, "gemma4_text": 3, "gemma4_unified": 3, "gpt_oss": 0, "minimax_m2": 0}
# sparse MoE blocks run as their declared parts (router, expert kernels), those with a shared expert with its
# one-logit gate and the router as further outputs of its gate/up GEMV
MOE = {"gpt_oss", "minimax_m2", "qwen3_moe", "qwen3_vl_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}
SHARED_EXPERT = {"qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"}


@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_each_family_takes_the_fused_kernels(model_type):
    """Which layers the static target routes through the fused kernels, read from the built engine (no
    forward): a module attribute that a new transformers release renames (Gemma 4's norms' `eps` became
    `variance_epsilon` in 5.25) must not silently drop a family to the slower torch path."""
    pytest.importorskip("triton")
    adapter, drafter = static_pair(model_type)
    t = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, **KERNELS).target
    own_attention = [m.q is not None and m.kv_source is None for m in t.layers]  # GDN and KV-shared: not
    assert any(own_attention)
    want = [own and model_type not in NO_ROPE_KERNEL for own in own_attention]
    assert t.rope_kernel == want
    # Gemma 4's sandwich norms: one kernel per residual add, unless the layer adds a per-layer input
    assert t.sandwich == [model_type.startswith("gemma4") and m.per_layer is None for m in t.layers]
    assert t.mlp.gate_act == GATE_ACT.get(model_type, 1)
    assert [m.moe_parts is not None for m in t.layers] == [model_type in MOE] * len(t.layers)
    assert set(t.moe.shared_extra) == {(model_type in SHARED_EXPERT,) * 2}
    gdn = [
        g for g in t.gdn if g is not None
    ]  # Gated-DeltaNet layers: the conv / delta-rule and gated-norm kernels
    assert bool(gdn) == (model_type in HYBRID) and all(g.kernel and g.norm_kernel for g in gdn)


def test_gemma4_kv_shared_layers_read_their_source_buffers():
    adapter, drafter = static_pair("gemma4_text")  # the tiny E2B-like config: the last 2 layers share K/V
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    shared = [i for i, m in enumerate(eng.target.layers) if m.kv_source is not None]
    assert shared == [4, 5]
    for i in shared:
        src = eng.target.layers[i].kv_source
        assert eng.target.layers[src].kind == eng.target.layers[i].kind and src < 4
        kv = eng.target.kv
        assert kv.k[i] is kv.k[src] and kv.v[i] is kv.v[src]
    assert eng.target.per_layer  # per-layer inputs are on in this config


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma4_text", "gemma4_unified"])
def test_sliding_rings_wrap_and_stay_exact(model_type):
    """Sliding layers keep a ring of slots (window 4, verify 8 rows: 64 slots) in a 256-row engine; after a
    prompt longer than the ring, 20 verify / commit rounds with random accepts run past position 128 (each ring
    wraps twice), and every verify's logits equal transformers' forward on the committed ids."""
    adapter, drafter = static_pair(model_type)
    eng = fast_engine(adapter, drafter, MASK, max_len=256, graphs=False)
    t = eng.target
    rings = {r for r in t.kv.ring if r}
    assert rings == {64} and t.kv.k[0].shape[2] == 64 and max(k.shape[2] for k in t.kv.k) > 64
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, MASK, (1, 70), generator=gen)  # longer than the ring
    kept = [prompt]
    with torch.inference_mode():
        pos = torch.zeros((), dtype=torch.long)
        t.forward(prompt, pos, prefill=True)
        pos = pos + prompt.shape[1]
        for _ in range(20):
            block = torch.randint(0, MASK, (1, 8), generator=gen)
            got = t.forward(block, pos)[0]  # [8, V]
            want = adapter.model(torch.cat([*kept, block], 1)).logits[0, -8:]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            n = int(torch.randint(1, 9, (1,), generator=gen))
            t.commit(torch.tensor(n))
            pos, kept = pos + n, [*kept, block[:, :n]]
    assert int(pos) > 2 * 64  # the rings wrapped twice
