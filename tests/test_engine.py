"""One engine interface: which engine runs (and why), streaming, sampling and the full-block drafting rule.

The full-block rule is checked against `reference_dflash` (tests/oracles.py): the upstream loop without any
cache, which drafts and verifies the whole block every step and truncates the output at the end. Both engines
must equal it wherever a whole block still fits, and in the tail verify a prefix of its proposals and commit
`min(reference, room)` tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dflash_zoo.adapters import find_adapter, get_adapter

from dflash_zoo import demo
from dflash_zoo.api import Pipeline, load
from dflash_zoo.engine.drafter import DFlashDrafter
from dflash_zoo.engine.factory import build_engine
from dflash_zoo.engine.options import FastOptions
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.engine.sampling import Sampler
from dflash_zoo.engine.select import EngineOptions, choose_engine
from dflash_zoo.engine.static_support import unsupported_reason
from tests.oracles import reference_dflash
from tests.static_matrix import EAGER_ONLY_MODEL_TYPES, STATIC_MODEL_TYPES, fast_engine, static_pair
from tests.test_sampling import N_RUNS, PROMPT, SETTINGS, V, chi_square_pvalue, exact_distribution
from tests.tiny import VOCAB, tiny_drafter, tiny_target

MASK = VOCAB - 1
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# ---- which engine, and why ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "device, options, split, images, expected",
    [
        ("cuda", EngineOptions(), False, False, "fast"),
        ("cuda:1", EngineOptions(fast_options=FastOptions(compile=True)), False, False, "fast"),
        ("cpu", EngineOptions(), False, False, "eager"),  # auto: the static engine is for CUDA
        ("cpu", EngineOptions(fast=True), False, False, "fast"),  # asked for: static buffers, no graphs
        ("cuda", EngineOptions(fast=False), False, False, "eager"),
        ("cuda", EngineOptions(), True, False, "eager"),  # split target
        ("cuda", EngineOptions(fast=True), False, True, "eager"),  # image prefill inputs
        ("cpu", EngineOptions(True, FastOptions(graphs=True)), False, False, "eager"),  # graphs: CUDA only
    ],
)
def test_engine_choice_for_a_supported_family(device, options, split, images, expected):
    adapter = get_adapter("qwen3")(tiny_target("qwen3"))
    choice = choose_engine(adapter, device, options, split=split, prefill_inputs=images)
    assert choice.name == expected
    assert choice.reason  # always says why


@pytest.mark.parametrize("model_type", EAGER_ONLY_MODEL_TYPES)
def test_engine_choice_for_a_family_without_a_static_layout(model_type):
    adapter = get_adapter(model_type)(tiny_target(model_type))
    for options in (EngineOptions(), EngineOptions(fast=True)):
        choice = choose_engine(adapter, "cuda", options)
        assert choice.name == "eager" and "fast engine unavailable" in choice.reason


def test_layouts_not_verified_on_cuda_take_the_static_engine_there_only_when_asked():
    """A layout that has not passed the GPU tests (`cuda_verified=False`, how a new family starts) runs the
    static engine on CUDA only with fast=True; auto keeps the eager engine and says why."""
    base = get_adapter("qwen3_5_text")

    class Unverified(base):
        static_layout = dataclasses.replace(base.static_layout, cuda_verified=False)

    for cls, auto_name in ((Unverified, "eager"), (base, "fast")):
        adapter = cls(tiny_target("qwen3_5_text"))
        auto = choose_engine(adapter, "cuda", EngineOptions())
        assert auto.name == auto_name
        assert choose_engine(adapter, "cpu", EngineOptions(fast=True)).name == "fast"
        assert choose_engine(adapter, "cuda", EngineOptions(fast=True)).name == "fast"
    assert "verified on CPU only" in auto_reason(Unverified) and "fast=True" in auto_reason(Unverified)


class StaticlessDrafter(DFlashDrafter):
    """A drafter architecture the static drafter does not run yet (as DFlash 2's until its static path)."""

    arch = "elsewhere"
    static_supported = False


def test_a_drafter_the_static_engine_cannot_run_goes_to_the_eager_engine():
    """`static_supported` on the drafter's class decides too: asked for the fast engine, such a pair gets the
    eager one, with the reason; the factory refuses it where the fast engine is required."""
    adapter, drafter = static_pair("qwen3")
    other = StaticlessDrafter(drafter.cfg)
    assert DFlashDrafter.static_supported and DFlashDrafter.arch == "dflash"
    for device in ("cpu", "cuda"):
        assert choose_engine(adapter, device, EngineOptions(fast=True), drafter=drafter).name == "fast"
        choice = choose_engine(adapter, device, EngineOptions(fast=True), drafter=other)
        assert choice.name == "eager" and "does not run elsewhere drafters" in choice.reason
    eng, choice = build_engine(adapter, other, MASK, EngineOptions(fast=True), 64)
    assert eng.name == "eager" and not choice.fast
    with pytest.raises(ValueError, match="fast engine cannot run this pair: .*elsewhere"):
        build_engine(adapter, other, MASK, EngineOptions(fast=True), 64, require="fast")
    with pytest.raises(ValueError, match="does not run elsewhere"):
        fast_engine(adapter, other, MASK, 64, graphs=False)  # the engine itself refuses it too


def test_the_factory_builds_the_engine_it_chose():
    """One call chooses and builds: the eager engine off CUDA by default and for fast=False, the static engine
    when asked for (with the options given, whole), and the eager engine for a family without a layout."""
    adapter, drafter = static_pair("qwen3")
    eng, choice = build_engine(adapter, drafter, MASK, EngineOptions(), 64)
    assert eng.name == choice.name == "eager" and "runs on CUDA by default" in choice.reason
    options = FastOptions(graphs=False, fuse=False, gemv_rows=4)
    eng, choice = build_engine(adapter, drafter, MASK, EngineOptions(True, options), 64, block_size=4)
    assert eng.name == "fast" and eng.options is options and eng.block == 4 and eng.max_len == 64
    mla = get_adapter("deepseek_v3")(tiny_target("deepseek_v3"))
    eng, choice = build_engine(mla, tiny_drafter(mla.model, seed=1), MASK, EngineOptions(fast=True), 64)
    assert eng.name == "eager" and "no static layout declared" in choice.reason
    with pytest.raises(ValueError, match="no static layout declared"):
        build_engine(mla, tiny_drafter(mla.model, seed=1), MASK, EngineOptions(fast=True), 64, require="fast")


def test_fast_options_read_the_environment_in_one_place():
    """Every switch users know maps to one field (`ENV`); explicit choices win; bad values are named."""
    from dflash_zoo.engine.options import ENV
    from dflash_zoo.errors import ConfigError

    env = {"DFLASH_ZOO_KERNELS": "0", "DFLASH_ZOO_TUNE": "0", "DFLASH_ZOO_MOE_ROWS": "4",
           "DFLASH_ZOO_GEMV_ROWS": "99", "DFLASH_ZOO_GDN_VERIFY": "chunk", "DFLASH_ZOO_FLA": "0",
           "DFLASH_ZOO_FP8": "w8a8", "DFLASH_ZOO_PDL": "0"}  # fmt: skip
    got = FastOptions.from_env(env)
    assert set(ENV) == set(env) and got.fp8 == "w8a8" and got.dependent_launch is False
    assert (got.kernels, got.tune, got.auto_moe_rows, got.gemv_rows, got.gdn_verify, got.fla) == (
        False,
        False,
        4,
        16,
        "chunk",
        False,
    )  # fmt: skip  (GEMV rows clamped to 16, as the variable always was)
    assert FastOptions.from_env({}) == FastOptions()
    assert FastOptions.from_env(env, tune=True, compile=True).tune is True
    assert FastOptions.from_env({"DFLASH_ZOO_GDN_VERIFY": "other"}).gdn_verify == "recurrent"
    with pytest.raises(ConfigError, match="DFLASH_ZOO_MOE_ROWS='many'"):
        FastOptions.from_env({"DFLASH_ZOO_MOE_ROWS": "many"})
    with pytest.raises(ConfigError, match="gdn_verify"):
        FastOptions(gdn_verify="sometimes")


def auto_reason(cls) -> str:
    return choose_engine(cls(tiny_target("qwen3_5_text")), "cuda", EngineOptions()).reason


def _pipe(options: EngineOptions, seed: int = 0) -> Pipeline:
    from tests.tiny import tiny_tokenizer

    target = tiny_target("qwen3", seed=seed)
    drafter = tiny_drafter(target, seed=1)
    return Pipeline(target, drafter, tiny_tokenizer(), mask_token_id=MASK, options=options)


@pytest.mark.parametrize("fast", [True, False])
def test_every_entry_point_goes_through_the_chosen_engine(fast):
    """generate, stream, chat, the autoregressive baseline and sampling all run on the chosen engine."""
    pipe = _pipe(EngineOptions(fast=fast))
    expected = "fast" if fast else "eager"
    calls = [
        lambda: pipe.generate("hello", raw=True, max_new_tokens=6),
        lambda: list(pipe.stream("hello", raw=True, max_new_tokens=6)),
        lambda: pipe.chat([{"role": "user", "content": "hi"}], max_new_tokens=6),
        lambda: pipe.generate_autoregressive("hello", raw=True, max_new_tokens=6),
        lambda: pipe.generate("hello", raw=True, max_new_tokens=6, temperature=0.9, top_p=0.9, seed=1),
    ]
    for call in calls:
        pipe.last_choice = None
        call()
        assert pipe.last_choice is not None and pipe.last_choice.name == expected


def test_load_takes_the_engine_options():
    pipe = load(fast=True, compile=False)  # the embedded demo pair, on CPU
    assert pipe.options.fast is True and not pipe.options.compile
    pipe.generate("def f(x):", raw=True, max_new_tokens=4)
    assert pipe.last_choice.name == "fast"


@pytest.mark.slow  # minutes of CPU on 2 cores (run by CI's slow leg)
def test_both_engines_give_the_same_tokens_and_steps_through_the_pipeline():
    eager, fast = _pipe(EngineOptions(fast=False)), _pipe(EngineOptions(fast=True))
    a = eager.generate("hello world", raw=True, max_new_tokens=21)
    b = fast.generate("hello world", raw=True, max_new_tokens=21)
    assert a.output_ids == b.output_ids and a.steps == b.steps and a.text == b.text


# ---- streaming --------------------------------------------------------------------------------------------
def test_the_fast_engine_streams_each_steps_tokens():
    adapter, drafter = static_pair("qwen3")
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    cfg = GenerationConfig(max_new_tokens=30)
    pieces: list[list[int]] = []
    res = eng.speculative(list(range(3, 13)), cfg, on_tokens=pieces.append)
    assert [t for p in pieces for t in p] == res.output_ids
    assert len(pieces) == len(res.steps) + 1  # the prefill's token, then one call per verify step
    assert [len(p) for p in pieces[1:]] == res.acceptance_lengths


def test_stream_on_the_fast_engine_equals_generate():
    pipe = _pipe(EngineOptions(fast=True))
    pieces = list(pipe.stream("hello world", raw=True, max_new_tokens=16))
    assert pipe.last_choice.name == "fast"
    assert "".join(pieces) == pipe.generate("hello world", raw=True, max_new_tokens=16).text


def test_streamed_text_adds_up_when_a_generation_ends_inside_a_character(demo_pair):
    """The held-back bytes of a split character come out at the end: pieces join to `text`."""
    pipe, _ = demo_pair
    prompt = "s = 'caf\u00e9 caf\u00e9 caf\u00e9"
    res = pipe.generate(prompt, raw=True, max_new_tokens=7)
    assert res.text.endswith("\ufffd")  # the case under test: the last token is a character's first byte
    assert "".join(pipe.stream(prompt, raw=True, max_new_tokens=7)) == res.text
    pieces: list[str] = []
    pipe.generate(prompt, raw=True, max_new_tokens=7, on_text=pieces.append)
    assert "".join(pieces) == res.text and all(pieces)


@pytest.mark.parametrize("fast", [False, True])
def test_a_newer_generation_ends_an_unfinished_stream_instead_of_corrupting_it(fast):
    """One pipeline runs one generation at a time (the fast engine's buffers, the eager loop's tap hooks): a
    stream left paused while another generation runs raises when resumed, never yields wrong tokens; the
    newer generation is exact."""
    from dflash_zoo.errors import ZooError

    pipe = _pipe(EngineOptions(fast=fast))
    ref = pipe.generate_autoregressive("hello world", raw=True, max_new_tokens=24).output_ids
    paused = pipe.generation("hello", raw=True, max_new_tokens=24)
    first = next(iter(paused))
    assert first  # it has started
    assert pipe.generate("hello world", raw=True, max_new_tokens=24).output_ids == ref
    with pytest.raises(ZooError, match="ended by a newer one on the same pipeline"):
        list(paused)


def test_stopping_early_still_ends_the_timings():
    """A consumer that stops iterating (Ctrl-C in chat) gets a result with its decode time and reason."""
    pipe = _pipe(EngineOptions(fast=True))
    gen = pipe.generation("hello world", raw=True, max_new_tokens=40)
    for i, _ in enumerate(gen):
        if i == 2:
            break
    res = gen.result
    assert res.stop_reason == "interrupted" and res.decode_seconds > 0 and len(res.output_ids) > 1


# ---- the full-block drafting rule -------------------------------------------------------------------------
def _engines(adapter, drafter, mask):
    """Both engines, through the factory."""
    fast = EngineOptions(True, FastOptions.from_env(graphs=False))
    return {
        "eager": build_engine(adapter, drafter, mask, EngineOptions(fast=False), 256, require="eager")[0],
        "fast": build_engine(adapter, drafter, mask, fast, 256, require="fast")[0],
    }


def _assert_full_block_rule(res, ref_out, ref_steps, block: int, max_new: int) -> None:
    assert res.output_ids == ref_out
    assert len(res.steps) == len(ref_steps)
    done = 1  # the prefill's token
    for step, (proposed, accepted) in zip(res.steps, ref_steps, strict=True):
        room = max_new - done
        if room >= block:  # a whole block fits: exactly the reference's step
            assert step.proposed == proposed
            assert step.accepted == accepted and step.acceptance_length == accepted + 1
        else:  # the tail: a prefix of the full-block proposals, and what can still be committed
            assert step.proposed == proposed[: room - 1]
            assert step.acceptance_length == min(accepted + 1, room)
        done += step.acceptance_length
    assert done == len(ref_out)


@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
@pytest.mark.parametrize("max_new", [19, 24])
def test_full_block_rule_on_tiny_pairs(model_type, max_new):
    adapter, drafter = static_pair(model_type)
    prompt = list(range(3, 15))
    block = drafter.cfg.block_size
    ref_out, ref_steps = reference_dflash(adapter, drafter, prompt, max_new, MASK)
    for eng in _engines(adapter, drafter, MASK).values():
        res = eng.speculative(prompt, GenerationConfig(max_new_tokens=max_new))
        _assert_full_block_rule(res, ref_out, ref_steps, block, max_new)


@pytest.fixture(scope="module")
def demo_pair():
    pipe = load(demo.target_dir(), demo.draft_dir(), device="cpu", dtype="fp32")
    prompt = pipe.encode(
        "import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n", raw=True
    )
    return pipe, prompt


@pytest.mark.slow
@pytest.mark.parametrize("max_new", [37])
def test_full_block_rule_on_the_trained_demo_pair(demo_pair, max_new):
    """A trained drafter gets long accepts, so the tail cuts real acceptance (not only 1-token steps)."""
    pipe, prompt = demo_pair
    block = pipe.drafter.cfg.block_size
    ref_out, ref_steps = reference_dflash(pipe.adapter, pipe.drafter, prompt, max_new, pipe.mask_token_id)
    assert sum(a + 1 for _, a in ref_steps) / len(ref_steps) > 2, (
        "the demo drafter should get drafts accepted"
    )
    for eng in _engines(pipe.adapter, pipe.drafter, pipe.mask_token_id).values():
        res = eng.speculative(prompt, GenerationConfig(max_new_tokens=max_new, stop_token_ids=()))
        _assert_full_block_rule(res, ref_out, ref_steps, block, max_new)


# ---- sampling on the static engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampling_engine():
    target = tiny_target("qwen3", seed=3, lm_scale=1.0, vocab_size=V)
    drafter = tiny_drafter(target, seed=4, block_size=4)
    return target, fast_engine(get_adapter("qwen3")(target), drafter, V - 1, max_len=32, graphs=False)


@pytest.fixture(scope="module")
def exact(sampling_engine):
    return exact_distribution(sampling_engine[0])


def _static_runs(eng, n_runs: int, override=None) -> tuple[dict, int]:
    counts, accepted = {}, 0
    for seed in range(n_runs):
        cfg = GenerationConfig(max_new_tokens=4, seed=seed, **SETTINGS)
        res = eng.speculative(PROMPT, cfg, accept_override=override)
        key = tuple(res.output_ids[1:])  # marginal over the prefill token, as in tests/test_sampling.py
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(s.accepted for s in res.steps)
    return counts, accepted


@pytest.mark.slow  # minutes of CPU on 2 cores (run by CI's slow leg)
def test_static_engine_sampling_matches_the_target_distribution(sampling_engine, exact):
    counts, accepted = _static_runs(sampling_engine[1], N_RUNS)
    assert accepted > N_RUNS // 4, "drafts must get accepted for the test to exercise the rule"
    assert chi_square_pvalue(counts, exact, N_RUNS) > 1e-3


class StubbornSampler(Sampler):
    """Proposes token 0 with certainty (q one-hot): the real rule must correct it, accepting blindly cannot."""

    def propose(self, draft_logits, generator):
        q = torch.zeros_like(draft_logits, dtype=torch.float32)
        q[:, 0] = 1.0
        return torch.zeros(draft_logits.shape[0], dtype=torch.long, device=draft_logits.device), q


@pytest.fixture
def stubborn_engine(sampling_engine, monkeypatch):
    import dflash_zoo.cuda.static.fast as fast

    monkeypatch.setattr(
        fast, "sampler_of", lambda cfg: StubbornSampler(cfg.temperature, cfg.top_k, cfg.top_p)
    )
    return sampling_engine


@pytest.mark.slow  # minutes of CPU on 2 cores (run by CI's slow leg)
def test_static_engine_corrects_a_certain_drafter(stubborn_engine, exact):
    """Every rejection samples the residual max(p - q, 0): the committed tokens still follow the target."""
    counts, accepted = _static_runs(stubborn_engine[1], N_RUNS)
    assert accepted > 0
    assert chi_square_pvalue(counts, exact, N_RUNS) > 1e-3


@pytest.mark.slow  # minutes of CPU on 2 cores (run by CI's slow leg)
def test_static_engine_with_a_broken_rule_fails_the_same_test(stubborn_engine, exact):
    """Accepting every draft must fail the same test: the test can fail on this engine too."""
    counts, _ = _static_runs(stubborn_engine[1], N_RUNS, override=lambda step, k: k)
    assert chi_square_pvalue(counts, exact, N_RUNS) < 1e-3


def test_static_engine_sampling_is_reproducible_per_seed():
    adapter, drafter = static_pair("qwen3", lm_scale=1.0)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=False)
    cfg = GenerationConfig(max_new_tokens=20, temperature=1.0, top_p=0.95, top_k=50)
    runs = [
        eng.speculative(list(range(3, 13)), GenerationConfig(**{**vars(cfg), "seed": s})) for s in (5, 5, 6)
    ]
    assert runs[0].output_ids == runs[1].output_ids and runs[0].steps == runs[1].steps
    assert runs[0].output_ids != runs[2].output_ids


def test_sampling_without_a_seed_leaves_the_global_rng_alone():
    pipe = _pipe(EngineOptions(fast=False))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    pipe.generate("hello", raw=True, max_new_tokens=8, temperature=1.0)
    assert torch.equal(torch.rand(3), expected)


def test_an_empty_stop_list_turns_the_default_stops_off():
    pipe = _pipe(EngineOptions(fast=False))
    first = pipe.generate("hello", raw=True, max_new_tokens=12, stop_token_ids=[]).output_ids
    i = next(i for i in range(1, len(first)) if first[i] not in first[:i])  # a token's first appearance
    pipe.stop_token_ids = (first[i],)
    assert pipe.generate("hello", raw=True, max_new_tokens=12).output_ids == first[: i + 1]
    assert pipe.generate("hello", raw=True, max_new_tokens=12, stop_token_ids=[]).output_ids == first


# ---- the same on a GPU, with CUDA graphs ----------------------------------------------------------------
@GPU[0]
@GPU[1]
def test_graphed_sampling_is_reproducible_per_seed_on_gpu():
    """The first generation captures the graphs: it must draw the same numbers as every later one."""
    adapter, drafter = static_pair("qwen3", device="cuda", lm_scale=1.0)
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=True)
    prompt = list(range(3, 13))
    runs = [
        eng.speculative(prompt, GenerationConfig(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=s))
        for s in (5, 5, 6)
    ]
    assert runs[0].output_ids == runs[1].output_ids and runs[0].steps == runs[1].steps
    assert runs[0].output_ids != runs[2].output_ids


@GPU[0]
@GPU[1]
def test_graphed_sampling_matches_the_target_distribution_on_gpu():
    target = tiny_target("qwen3", seed=3, lm_scale=1.0, vocab_size=V).cuda()
    drafter = tiny_drafter(target, seed=4, block_size=4).cuda()
    eng = fast_engine(get_adapter("qwen3")(target), drafter, V - 1, max_len=32, graphs=True)
    counts, accepted = _static_runs(eng, N_RUNS)
    assert accepted > N_RUNS // 4
    assert chi_square_pvalue(counts, exact_distribution(target.cpu()), N_RUNS) > 1e-3


@GPU[0]
@GPU[1]
def test_graphed_streaming_equals_the_result_on_gpu():
    adapter, drafter = static_pair("qwen3", device="cuda")
    eng = fast_engine(adapter, drafter, MASK, max_len=64, graphs=True)
    pieces: list[list[int]] = []
    res = eng.speculative(list(range(3, 13)), GenerationConfig(max_new_tokens=30), on_tokens=pieces.append)
    assert [t for p in pieces for t in p] == res.output_ids and len(pieces) == len(res.steps) + 1


def test_bench_measures_the_engine_generate_would_pick(tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    from dflash_zoo.cli import cli

    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    args = ["bench", "--shape", "tiny-qwen3", "--prompt-tokens", "6", "--max-new-tokens", "8"]
    args += ["--warmup", "0", "--repeats", "1", "--device", "cpu", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "engine: eager (auto: the fast engine runs on CUDA by default" in result.stderr
    assert list(json.loads(result.stdout)["results"]) == ["eager"]


# ---- rotary that switches with a forward's length ----------------------------------------------------------
LONGROPE = dict(
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
    long_factor=[float(i + 2) for i in range(8)], original_max_position_embeddings=32,
)  # fmt: skip


@pytest.mark.parametrize("family", ["qwen3"])
def test_longrope_verify_blocks_stop_where_its_factors_switch(family):
    """transformers' longrope rotates a whole forward with its long factors once its last position reaches 32:
    a verify block across 32 would cache keys that token-by-token decoding rotates with the short factors."""
    from tests.oracles import greedy_reference

    target = tiny_target(family, max_position_embeddings=128, rope_parameters=LONGROPE)
    adapter, drafter = find_adapter(family)(target), tiny_drafter(target, seed=1)
    assert "longrope rotary switches its factors at position 32" in unsupported_reason(adapter)
    eager = build_engine(adapter, drafter, MASK, EngineOptions(fast=False), 128, require="eager")[0]
    for seed in range(3):
        prompt = torch.randint(5, 100, (20,), generator=torch.Generator().manual_seed(seed)).tolist()
        res = eager.speculative(prompt, GenerationConfig(max_new_tokens=40, stop_token_ids=()))
        assert res.output_ids == greedy_reference(target, prompt, 40)
        ends = [20 + sum(res.acceptance_lengths[: i + 1]) for i in range(len(res.steps))]
        assert 32 in ends  # a block stopped at the switch (positions before it never verified with the rest)
