"""Speculative sampling preserves the target's distribution: a chi-square goodness-of-fit test against the
exact distribution of the target's own sampling (enumerated), plus a broken rule that the same test rejects."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash_zoo.engine.decode import SpeculativeDecoder
from dflash_zoo.engine.results import SAMPLING_RULE, GenerationConfig
from dflash_zoo.engine.sampling import processed_probs
from tests.tiny import DFLASH2_PARAMS, tiny_dflash2, tiny_drafter, tiny_target

V, N_TOKENS, PROMPT = 3, 4, [1, 0, 1]
SETTINGS = dict(temperature=1.3, top_p=0.95, top_k=0)


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def pair(request):
    """DFlash drafts each slot from its own q; DFlash 2 draws slot by slot from its selector's q over the top-2
    candidates (zero elsewhere), so the residual max(p - q, 0) also covers tokens it never proposes."""
    target = tiny_target("qwen3", seed=3, lm_scale=1.0, vocab_size=V)
    if request.param == "dflash":
        return target, tiny_drafter(target, seed=4, block_size=4)
    params = {**DFLASH2_PARAMS, "selector_top_k": 2}
    return target, tiny_dflash2(target, seed=4, block_size=4, params=params)


class StubbornDecoder(SpeculativeDecoder):
    """Always proposes token 0 with certainty (q = one-hot): accepting blindly would force 0s."""

    def _draft(self, bonus, feats, dkv, pos, b, gen):
        q = torch.zeros(b - 1, V)
        q[:, 0] = 1.0
        return torch.zeros(b - 1, dtype=torch.long), q


def exact_distribution(target) -> dict[tuple[int, ...], float]:
    """P(x1..xn) of plain sampling with SETTINGS, enumerated exactly from the target's logits."""
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=N_TOKENS):
            logits = target(input_ids=torch.tensor([PROMPT + list(seq[:-1])])).logits[0, len(PROMPT) - 1 :]
            p = processed_probs(logits, **SETTINGS)  # [N_TOKENS, V]
            key = seq[1:]  # marginal over the prefill token x1
            probs[key] = probs.get(key, 0.0) + float(torch.prod(p[torch.arange(N_TOKENS), torch.tensor(seq)]))
    return probs


def sample_runs(target, drafter, n_runs: int, override=None, decoder=SpeculativeDecoder):
    from dflash_zoo.adapters import get_adapter

    adapter = get_adapter("qwen3")(target)
    counts, accepted = {}, 0
    for seed in range(n_runs):
        cfg = GenerationConfig(max_new_tokens=N_TOKENS, seed=seed, **SETTINGS)
        dec = decoder(adapter, drafter, PROMPT, cfg, V - 1, accept_override=override)
        for _ in dec:
            pass
        key = tuple(dec.result.output_ids[1:])  # tokens 2-4: the two drafted slots of step 1 and its bonus
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(s.accepted for s in dec.result.steps)
        assert dec.result.acceptance_rule == SAMPLING_RULE
    return counts, accepted


def chi_square_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square p-value; cells with expected count < 5 are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for seq, p in probs.items():
        exp, obs = p * n, counts.get(seq, 0)
        if exp < 5:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + exp
            continue
        stat, cells = stat + (obs - exp) ** 2 / exp, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    dof = cells - 1
    assert dof >= 1, "too few runs for a chi-square test"
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)
        )
    )


N_RUNS = 400


def test_speculative_sampling_matches_target_distribution(pair):
    target, drafter = pair
    probs = exact_distribution(target)
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5)
    counts, accepted = sample_runs(target, drafter, N_RUNS)
    assert accepted > N_RUNS // 4, "the drafter must get drafts accepted for the test to exercise the rule"
    assert chi_square_pvalue(counts, probs, N_RUNS) > 1e-3


def test_a_certain_drafter_is_corrected_by_the_rule(pair):
    """A one-hot drafter exercises the residual distribution max(p - q, 0) on every rejection."""
    target, drafter = pair
    counts, accepted = sample_runs(target, drafter, N_RUNS, decoder=StubbornDecoder)
    assert accepted > 0
    assert chi_square_pvalue(counts, exact_distribution(target), N_RUNS) > 1e-3


def test_a_broken_acceptance_rule_is_detected(pair):
    """Accepting every draft must fail the same test: the test can fail."""
    target, drafter = pair
    counts, _ = sample_runs(target, drafter, N_RUNS, override=lambda step, k: k, decoder=StubbornDecoder)
    assert chi_square_pvalue(counts, exact_distribution(target), N_RUNS) < 1e-3
