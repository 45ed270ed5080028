"""DFlash 2 on the static engine (cuda/static/drafter2.py) against the eager engine, fp32: greedy proposals, steps
and output token for token; sampling with the same seed identical (both draw the selector's race at once);
the kernels (block convolution, selector walk) under Triton's interpreter on CPU, in CUDA graphs on a GPU."""

from __future__ import annotations

import pytest
import torch
from dflash_zoo.adapters import get_adapter

from dflash_zoo.engine.decode import EagerEngine
from dflash_zoo.engine.results import GenerationConfig
from tests.static_matrix import fast_engine
from tests.tiny import DFLASH2_PARAMS, VOCAB, tiny_dflash2, tiny_target

MASK = VOCAB - 1
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3", seed=0)
    return get_adapter("qwen3")(target), tiny_dflash2(target, seed=3, **SLIDING)


def _prompts():
    return [
        torch.randint(0, MASK, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 13)
    ]


def _same(a, b, block: int = 8):
    """Equal steps and output, up to the first step that verified less than a full block: there the eager
    engine verifies only the slots that can still be committed and draws fewer acceptance numbers than the
    static engine's full-block step, so sampled runs part ways (greedy ones stay equal to the end)."""
    full = [s for s in a.steps if len(s.proposed) == block - 1]
    n = next((i for i, s in enumerate(a.steps) if len(s.proposed) < block - 1), len(a.steps))
    assert len(full) >= 3 and n == len(full)
    rows = [[(s.proposed, s.accepted, s.acceptance_length) for s in r.steps[:n]] for r in (a, b)]
    assert rows[0] == rows[1]
    done = 1 + sum(s.acceptance_length for s in a.steps[:n])
    assert a.output_ids[:done] == b.output_ids[:done]


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_static_dflash2_equals_eager(pair, kernels, temperature):
    if kernels:
        pytest.importorskip("triton")
    adapter, drafter = pair
    cfg = GenerationConfig(max_new_tokens=30, temperature=temperature, seed=11)
    fast = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, fused_ops=kernels, gemv=False,
                       block_attention="sdpa", decode_attention="sdpa")  # fmt: skip
    assert fast.sdraft.kernels is kernels
    eager = EagerEngine(adapter, drafter, MASK)
    for prompt in _prompts():
        got, want = fast.speculative(prompt, cfg), eager.speculative(prompt, cfg)
        _same(got, want)
        if not temperature:
            assert got.output_ids == want.output_ids


@pytest.mark.slow  # minutes of CPU on 2 cores (run by CI's slow leg)
def test_static_dflash2_sampling_matches_the_target_distribution():
    """The selector's q on the static engine passes the sampling test of tests/test_sampling.py."""
    from tests.test_engine import N_RUNS, V, _static_runs
    from tests.test_sampling import chi_square_pvalue, exact_distribution

    target = tiny_target("qwen3", seed=3, lm_scale=1.0, vocab_size=V)
    drafter = tiny_dflash2(target, seed=4, block_size=4, params={**DFLASH2_PARAMS, "selector_top_k": 2})
    eng = fast_engine(get_adapter("qwen3")(target), drafter, V - 1, max_len=32, graphs=False)
    counts, accepted = _static_runs(eng, N_RUNS)
    assert accepted > N_RUNS // 4
    assert chi_square_pvalue(counts, exact_distribution(target), N_RUNS) > 1e-3


def test_selector_switch_reaches_the_static_engine(pair):
    """`selector_off` changes the static engine's proposals as it does the eager one's (its own graph key)."""
    adapter, drafter = pair
    cfg = GenerationConfig(max_new_tokens=30)
    fast = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    eager = EagerEngine(adapter, drafter, MASK)
    prompt = _prompts()[1]
    with_sel = fast.speculative(prompt, cfg)
    with drafter.selector_off():
        without = fast.speculative(prompt, cfg)
        _same(without, eager.speculative(prompt, cfg))
    assert [s.proposed for s in with_sel.steps] != [s.proposed for s in without.steps]


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_graphed_dflash2_equals_eager_fp32(temperature):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = tiny_target("qwen3", seed=0).cuda()
    adapter = get_adapter("qwen3")(target)
    params = {**DFLASH2_PARAMS, "selector_top_k": 8}
    drafter = tiny_dflash2(target, seed=3, params=params, **SLIDING).cuda()
    cfg = GenerationConfig(max_new_tokens=40, temperature=temperature, seed=5)
    fast = fast_engine(adapter, drafter, MASK, max_len=96)
    eager = EagerEngine(adapter, drafter, MASK)
    for prompt in _prompts():
        got, want = fast.speculative(prompt, cfg), eager.speculative(prompt, cfg)
        _same(got, want)
        assert temperature or got.output_ids == want.output_ids
