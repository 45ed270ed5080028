"""One matrix over every registered adapter (a new adapter is tested automatically).

For each model_type: taps equal `hidden_states[id + 1]`, hooks are removed, `embed` equals layer 0's input,
`logits` equals the target's logits, rollback after a partial accept equals a clean prefill, and speculative
greedy output equals transformers' greedy decoding for random, one-error and oracle drafters (fp32); a declared
`static_layout` names only modules the target has (the fast-vs-eager comparisons are in tests/test_fast.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from dflash_zoo.adapters import get_adapter, supported_model_types

from dflash_zoo import compat
from dflash_zoo.engine.decode import SpeculativeDecoder
from dflash_zoo.engine.results import GenerationConfig
from tests.oracles import OracleDecoder, greedy_reference
from tests.tiny import LM_SCALE, VOCAB, tiny_drafter, tiny_target

MODEL_TYPES = supported_model_types()


@pytest.fixture(scope="module", params=MODEL_TYPES)
def family(request):
    model = tiny_target(request.param, seed=0)
    return request.param, model, get_adapter(request.param)(model)


def _hook_count(adapter) -> int:
    return sum(len(layer._forward_hooks) for layer in adapter.layers())


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB - 2) for _ in range(n)]


def test_static_layout_resolves_or_is_not_declared(family):
    """A declared layout finds every module it names in the tiny target; without one the fast path says why."""
    from dflash_zoo.cuda.static.layout import resolve
    from dflash_zoo.engine.static_support import unsupported_reason

    model_type, _, adapter = family
    if adapter.static_layout is None:
        assert unsupported_reason(adapter) == f"no static layout declared by the {model_type!r} adapter"
        return
    mods = resolve(adapter)
    assert len(mods.layers) == adapter.num_layers and mods.final_norm is not None
    assert unsupported_reason(adapter) is None


def test_taps_match_hidden_states_and_hooks_are_removed(family):
    _, model, adapter = family
    ids = torch.tensor([_prompt(0, 20)])
    taps = list(range(adapter.num_layers - 1))  # the last layer's HF state is post-norm: not comparable
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True).hidden_states
        before = _hook_count(adapter)  # transformers may keep its own output-capture hooks installed
        with adapter.tap(taps) as rec:
            model(input_ids=ids)
            assert _hook_count(adapter) == before + len(taps)
            feats = rec.take()
    assert _hook_count(adapter) == before
    expected = torch.cat([ref[i + 1] for i in taps], dim=-1)
    torch.testing.assert_close(feats, expected, rtol=0, atol=1e-6)


def test_embed_is_layer0_input_and_logits_match(family):
    _, model, adapter = family
    ids = torch.tensor([_prompt(1, 12)])
    seen = {}

    def pre_hook(_module, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]

    handle = adapter.layers()[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
    finally:
        handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(adapter.embed(ids), seen["x"], rtol=0, atol=1e-6)
        torch.testing.assert_close(adapter.logits(out.hidden_states[-1]), out.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("prompt_len,keep", [(12, 3), (12, 8), (3, 1), (30, 5)])
def test_rollback_equals_clean_prefill(family, prompt_len, keep):
    """Prefill, verify 8 tokens, keep `keep` of them, feed one more: logits equal a clean forward."""
    _, model, adapter = family
    prompt, block, nxt = _prompt(2, prompt_len), _prompt(3, 8), _prompt(4, 1)
    with torch.no_grad():
        cache = adapter.new_cache()
        adapter.forward(torch.tensor([prompt]), cache)
        adapter.start_decoding(cache)
        for _ in range(2):  # two verify rounds so rollback runs on an already rolled-back cache
            snap = adapter.snapshot(cache)
            adapter.forward(torch.tensor([block]), cache)
            adapter.rollback(cache, len(block) - keep, snap, torch.tensor([block[:keep]]))
            prompt = prompt + block[:keep]
        got = adapter.forward(torch.tensor([nxt]), cache)[0, -1]
        clean = compat.forward(model, torch.tensor([prompt + nxt]), compat.new_cache(model.config))[0, -1]
    # 1e-5 on the logits of an unscaled head: the tiny head is LM_SCALE x larger, so are its rounding errors
    assert (got - clean).abs().max().item() <= 1e-5 * LM_SCALE


def _spec(adapter, drafter, prompt, n, block, reference=None, error_rate=0.0, seed=0):
    cfg = GenerationConfig(max_new_tokens=n, block_size=block)
    if reference is None:
        dec = SpeculativeDecoder(adapter, drafter, prompt, cfg, VOCAB - 1)
    else:
        dec = OracleDecoder(
            adapter, drafter, prompt, cfg, VOCAB - 1, reference=reference, error_rate=error_rate, seed=seed
        )
    for _ in dec:
        pass
    return dec.result


@pytest.mark.parametrize("seed", range(4))
def test_speculative_greedy_equals_plain_greedy(family, seed):
    _, model, adapter = family
    drafter = tiny_drafter(model, seed=seed, block_size=8)
    rng = random.Random(seed)
    for trial in range(3):
        prompt = _prompt(100 * seed + trial, rng.choice([1, 2, 7, 19]))
        n = rng.choice([1, 5, 24, 40])
        ref = greedy_reference(model, prompt, n)
        random_run = _spec(adapter, drafter, prompt, n, block=rng.choice([2, 5, 8]))
        assert random_run.output_ids == ref, "random drafter diverged"
        one_error = _spec(adapter, drafter, prompt, n, 8, reference=ref, error_rate=1.0, seed=seed)
        assert one_error.output_ids == ref, "one-error drafter diverged"
        oracle = _spec(adapter, drafter, prompt, n, 8, reference=ref)
        assert oracle.output_ids == ref, "oracle drafter diverged"
        assert len(oracle.output_ids) == n
        # a perfect drafter fills every block except a shortened last one
        assert all(s.acceptance_length == min(8, n - 1 - 8 * i) for i, s in enumerate(oracle.steps))
