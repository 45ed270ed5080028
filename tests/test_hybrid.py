"""Hybrid Gated-DeltaNet targets: the recompute rollback equals the replay rollback, the closed-form delta rule
equals the step-by-step recurrence, a plain crop is demonstrably wrong, and rollbacks that cannot be exact are
refused. The adapter matrix (test_adapter_matrix.py) covers the default rollback end to end."""

from __future__ import annotations

import random

import pytest
import torch
from dflash_zoo.adapters import get_adapter
from dflash_zoo.adapters._hybrid import gated_delta_final_state
from dflash_zoo.adapters.base import require_croppable

from dflash_zoo import compat
from dflash_zoo.errors import UnsupportedModelError
from tests.tiny import VOCAB, tiny_target

FUSED_AND_SPLIT = ["qwen3_5_text", "qwen3_next"]  # the two GDN projection layouts


@pytest.fixture(scope="module", params=FUSED_AND_SPLIT)
def hybrid(request):
    return request.param, tiny_target(request.param, seed=0)


def _ids(seed: int, n: int) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([[rng.randrange(3, VOCAB - 2) for _ in range(n)]])


def _verify_and_roll(adapter, prompt, block, keep: int):
    cache = adapter.new_cache()
    adapter.forward(prompt, cache)
    adapter.start_decoding(cache)
    snap = adapter.snapshot(cache)
    adapter.forward(block, cache)
    adapter.rollback(cache, block.shape[1] - keep, snap, block[:, :keep])
    return cache


def _linear_states(cache, ids):
    return [(cache.layers[i].conv_states[0], cache.layers[i].recurrent_states[0]) for i in ids]


@pytest.mark.parametrize("keep", [1, 4, 8])
def test_recompute_rollback_equals_replay(hybrid, keep):
    model_type, model = hybrid
    fast, slow = (get_adapter(model_type)(model, rollback=mode) for mode in ("recompute", "replay"))
    prompt, block, nxt = _ids(0, 11), _ids(1, 8), _ids(2, 3)
    with torch.no_grad():
        c_fast = _verify_and_roll(fast, prompt, block, keep)
        c_slow = _verify_and_roll(slow, prompt, block, keep)
        for (cf, rf), (cs, rs) in zip(
            _linear_states(c_fast, fast.linear_ids), _linear_states(c_slow, slow.linear_ids), strict=True
        ):
            torch.testing.assert_close(cf, cs, rtol=0, atol=1e-6)
            torch.testing.assert_close(rf, rs, rtol=0, atol=1e-5)
        assert c_fast.get_seq_length() == c_slow.get_seq_length() == 11 + keep
        torch.testing.assert_close(fast.forward(nxt, c_fast), slow.forward(nxt, c_slow), rtol=0, atol=1e-5)
    assert all(not m._forward_hooks for m in model.modules()), "capture hooks left behind"


def test_closed_form_equals_step_by_step_recurrence():
    torch.manual_seed(0)
    b, h, n, dk, dv = 1, 3, 9, 8, 5
    state = torch.randn(b, h, dk, dv)
    k = torch.nn.functional.normalize(torch.randn(b, h, n, dk), dim=-1)
    v, beta = torch.randn(b, h, n, dv), torch.rand(b, h, n)
    g = -torch.rand(b, h, n) * 3  # log decays <= 0
    ref = state.clone()
    for t in range(n):  # S = exp(g) S; S += k (beta (v - S^T k))^T
        ref = ref * g[..., t, None, None].exp()
        delta = beta[..., t, None] * (v[..., t, :] - (ref * k[..., t, :, None]).sum(-2))
        ref = ref + k[..., t, :, None] * delta[..., None, :]
    torch.testing.assert_close(gated_delta_final_state(state, k, v, g, beta), ref, rtol=1e-5, atol=1e-5)


def _recurrent(cache, ids):
    return torch.stack([cache.layers[i].recurrent_states[0] for i in ids])  # [L_lin, B, Hv, Dk, Dv]


def test_plain_crop_is_silently_wrong_and_ours_is_exact(hybrid):
    """Why the adapter owns rollback: crop trims the conv window but leaves the recurrent state after the block
    (transformers before 5.25), or, with no per-token states kept for it, has no state to go back to (5.25
    raises; keeping them runs the verify one token at a time).

    Compared on the states, not the logits: a tiny random target's GDN layers move logits only by ~1e-5.
    """
    model_type, model = hybrid
    adapter = get_adapter(model_type)(model)
    prompt, block, keep = _ids(3, 12), _ids(4, 8), 3
    with torch.no_grad():
        clean = compat.new_cache(model.config)
        compat.forward(model, torch.cat([prompt, block[:, :keep]], dim=1), clean)
        cropped = compat.new_cache(model.config)
        compat.forward(model, prompt, cropped)
        compat.record_past(cropped)
        compat.forward(model, block, cropped)
        try:
            cropped.crop(-(8 - keep))
        except IndexError:  # 5.25: no kept state to select
            cropped = None
        ours = _verify_and_roll(adapter, prompt, block, keep)
    ref = _recurrent(clean, adapter.linear_ids)
    if cropped is not None:
        crop_err = (_recurrent(cropped, adapter.linear_ids) - ref).abs().max() / ref.abs().max()
        assert crop_err > 1e-2, "crop unexpectedly rewound the recurrent state"
    ours_err = (_recurrent(ours, adapter.linear_ids) - ref).abs().max() / ref.abs().max()
    assert ours_err < 1e-5
    assert ours.get_seq_length() == 12 + keep  # the layers' token counts rolled back too


def test_crop_rollback_on_a_stateful_cache_is_refused(hybrid):
    _, model = hybrid
    with torch.no_grad():
        cache = compat.new_cache(model.config)
        compat.forward(model, _ids(6, 5), cache)
    with pytest.raises(UnsupportedModelError, match="recurrent state"):
        require_croppable(cache, "TargetAdapter")


def test_plain_cache_passes_the_croppable_guard():
    model = tiny_target("qwen3", seed=0)
    with torch.no_grad():
        cache = compat.new_cache(model.config)
        compat.forward(model, _ids(7, 5), cache)
    require_croppable(cache, "qwen3")


def test_unknown_stateful_layer_type_is_refused():
    model = tiny_target("qwen3_5_text", seed=0)
    model.config.layer_types[1] = "mamba"  # a stateful layer the GDN rollback cannot rewind
    with pytest.raises(UnsupportedModelError, match="mamba"):
        get_adapter("qwen3_5_text")(model)


def test_unknown_rollback_mode_and_vlm_config_without_text_config():
    model = tiny_target("qwen3_5_text", seed=0)
    with pytest.raises(ValueError, match="rollback"):
        get_adapter("qwen3_5_text")(model, rollback="crop")
    problems = get_adapter("qwen3_5").validate({"model_type": "qwen3_5", "hidden_size": 64}, draft=None)
    assert [p.code for p in problems] == ["text_config"]
