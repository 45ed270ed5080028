"""DFlash 2 drafters against z-lab's reference package (`dflash` 0.1.0), and the strict drafter loader.

Conformance (eager engine, fp32): for random DFlash 2 drafters, for DFlash 1 drafters, and for the trained demo
drafter upgraded to DFlash 2 and perturbed (so acceptance is non-trivial), greedy output, the acceptance length
of every step and the proposals of every full-block step equal those of the reference `dflash_generate`;
drafter states, logits and selector scores equal the reference modules' to 1e-5. Saved drafters load in the
reference classes with every tensor consumed, and the reference's saves load in ours.
"""

from __future__ import annotations

import json

import pytest
import torch
from dflash_zoo.adapters import get_adapter
from safetensors.torch import load_file, save_file

from dflash_zoo.drafters import DFlash2Params
from dflash_zoo.drafters.dflash2 import DFlash2Drafter
from dflash_zoo.engine.checkpoint import load_drafter, save_drafter
from dflash_zoo.engine.config import load_draft_config, normalize_draft_config
from dflash_zoo.engine.decode import EagerEngine
from dflash_zoo.engine.drafter import DFlashDrafter, DraftKV, Span
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.errors import ConfigError, DrafterFormatError
from tests.reference import load_reference_drafter, reference_module, reference_run
from tests.static_matrix import fast_engine
from tests.tiny import DFLASH2_PARAMS as PARAMS
from tests.tiny import VOCAB, dflash2_config, draft_config_dict, randomize, tiny_dflash2, tiny_target


def ours(target, drafter, prompt, max_new_tokens, model_type="qwen3", engine="eager"):
    """Our greedy run on the eager engine, or on the static one (no graphs on CPU; kernels off: the CUDA wing's
    own tests cover them)."""
    adapter = get_adapter(model_type)(target)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    mask = drafter.cfg.mask_token_id
    if engine == "eager":
        return EagerEngine(adapter, drafter, mask).speculative(prompt, cfg)
    fast = fast_engine(adapter, drafter, mask, max_len=len(prompt) + max_new_tokens, graphs=False)
    return fast.speculative(prompt, cfg)


def assert_conforms(result, ref, block):
    """Output, acceptance lengths, and the proposals of every step the reference drafted with a full block."""
    assert result.output_ids == ref.output_ids
    full = [i for i, v in enumerate(ref.verified) if len(v) == block]
    assert full and full == list(range(len(full))), "the full-block steps come first"
    lengths = [s.acceptance_length for s in result.steps]
    assert lengths[: len(full)] == ref.acceptance_lengths[: len(full)]
    for i in full:  # near the end the reference verifies one draft that can no longer be committed; we do not
        mine, theirs = result.steps[i].proposed, ref.verified[i][1:]
        assert mine == theirs[: len(mine)] and len(mine) >= len(theirs) - 1, f"step {i}"


PROMPTS = [[5, 9, 3, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [200, 17]]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=0)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("sliding", [False, True])
def test_greedy_conforms_to_reference(tmp_path, target, arch, sliding):
    reference_module()
    extra = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6} if sliding else {}
    if arch == "dflash2":
        drafter = tiny_dflash2(target, seed=3, **extra)
    else:
        torch.manual_seed(3)
        drafter = DFlashDrafter(normalize_draft_config(draft_config_dict(target, **extra))).float().eval()
    save_drafter(drafter, tmp_path / "d")
    ref = load_reference_drafter(tmp_path / "d", dflash2=arch == "dflash2")
    mine = load_drafter(tmp_path / "d")
    assert type(mine) is type(drafter)
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = reference_run(ref, target, prompt, 40)
        for engine in ("eager", "static"):
            assert_conforms(ours(target, mine, prompt, 40, engine=engine), expected, 8)


@pytest.mark.parametrize("act", ["relu", "gelu_pytorch_tanh"])
def test_drafter_activations_conform_to_reference(tmp_path, target, act):
    """The reference takes transformers' ACT2FN[hidden_act]; ours the same function by name."""
    reference_module()
    torch.manual_seed(3)
    drafter = DFlashDrafter(normalize_draft_config(draft_config_dict(target, hidden_act=act))).float().eval()
    save_drafter(drafter, tmp_path / "d")
    ref = load_reference_drafter(tmp_path / "d", dflash2=False)
    with torch.no_grad():
        expected = reference_run(ref, target, PROMPTS[1], 40)
    assert_conforms(ours(target, load_drafter(tmp_path / "d"), PROMPTS[1], 40), expected, 8)
    with pytest.raises(ConfigError, match="hidden_act 'gelu_new' is not one dflash-zoo's drafter runs"):
        normalize_draft_config(draft_config_dict(target, hidden_act="gelu_new"))


def test_a_scaled_embedding_target_conforms_where_the_config_names_the_block_scale(tmp_path):
    """Gemma 4 scales its embeddings by sqrt(H). A DFlash drafter sees the block as the target embeds it
    (docs/method.md: how the published Gemma 4 drafters are served), which z-lab's torch reference does not
    (raw rows): the same output, other drafts. With `input_embedding_scale` in its config, both embed raw rows
    times it, and the proposals conform."""
    reference_module()
    target = tiny_target("gemma4", seed=0)
    ids = torch.tensor([[3, 5]])
    adapter = get_adapter("gemma4")(target)
    assert not torch.allclose(adapter.embed(ids), adapter.embed_rows(ids))  # the two embeddings differ here
    prompt = PROMPTS[1]
    for scale, conforms in ((None, False), (1.0, True)):
        extra = {} if scale is None else {"input_embedding_scale": scale}
        torch.manual_seed(3)
        drafter = DFlashDrafter(normalize_draft_config(draft_config_dict(target, **extra))).float().eval()
        save_drafter(drafter, tmp_path / str(scale))
        ref = load_reference_drafter(tmp_path / str(scale), dflash2=False)
        with torch.no_grad():
            expected = reference_run(ref, target, prompt, 40)
        result = ours(target, load_drafter(tmp_path / str(scale)), prompt, 40, model_type="gemma4")
        assert result.output_ids == expected.output_ids
        if conforms:
            assert_conforms(result, expected, 8)
        else:
            assert result.steps[0].proposed != expected.verified[0][1:]


@pytest.fixture(scope="module")
def demo_pair():
    """The embedded demo pair's trained drafter, upgraded to DFlash 2 and perturbed: non-trivial acceptance."""
    import transformers

    from dflash_zoo import demo

    target_dir, draft_dir = demo.target_dir(), demo.draft_dir()
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    v1 = load_drafter(draft_dir)
    v2 = DFlash2Drafter.from_dflash(v1, DFlash2Params(2, 16, 16, 8))
    return target, v1, randomize(v2, seed=7, scale=0.02)


def test_trained_drafter_upgraded_and_perturbed_conforms(tmp_path, demo_pair):
    reference_module()
    target, _, drafter = demo_pair
    save_drafter(drafter, tmp_path / "d")
    ref = load_reference_drafter(tmp_path / "d", dflash2=True)
    prompt = [int(t) for t in torch.randint(10, 8000, (24,), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        expected = reference_run(ref, target, prompt, 96)
    mine = load_drafter(tmp_path / "d")
    result = ours(target, mine, prompt, 96)
    assert_conforms(result, expected, drafter.cfg.block_size)
    assert_conforms(ours(target, mine, prompt, 96, engine="static"), expected, drafter.cfg.block_size)
    assert result.mean_acceptance_length > 2.0, (
        "the perturbed drafter must keep accepting for this to test much"
    )


def test_upgrade_path_keeps_greedy_proposals(demo_pair):
    """`from_dflash` starts DFlash 2's parts neutral: the same proposals as the DFlash 1 drafter."""
    target, v1, _ = demo_pair
    v2 = DFlash2Drafter.from_dflash(v1, DFlash2Params(2, 16, 16, 8))
    prompt = list(range(40, 70))
    a, b = ours(target, v1, prompt, 48), ours(target, v2, prompt, 48)
    assert [s.proposed for s in a.steps] == [s.proposed for s in b.steps]


def test_states_logits_and_selector_scores_match_reference_modules(tmp_path, target):
    mod = reference_module()
    drafter = tiny_dflash2(target, seed=5)
    save_drafter(drafter, tmp_path / "d")
    ref = load_reference_drafter(tmp_path / "d", dflash2=True)
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 6, drafter.cfg.num_taps * drafter.cfg.hidden_size, generator=gen)
    emb = torch.randn(1, 8, drafter.cfg.hidden_size, generator=gen)
    with torch.no_grad():
        mine = drafter(emb, ctx, Span(q_pos=torch.arange(6, 14), ctx_pos=torch.arange(6)), DraftKV())
        theirs = ref(position_ids=torch.arange(14)[None], noise_embedding=emb, target_hidden=ctx)
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
        head = target.get_output_embeddings()
        logits = drafter.draft_logits(mine[0, 1:], head)
        torch.testing.assert_close(logits, ref.compute_logits(theirs[0, 1:], head), atol=1e-5, rtol=1e-5)
        anchor = torch.tensor([17])
        sel, rsel = drafter.candidate_selector, ref.candidate_selector
        unary, cands, succ, proj = sel.candidates(mine[0, 1:], logits)
        rproj = rsel.hidden_projection(theirs[:, 1:])
        prev, rprev = anchor, anchor
        path, _, _ = sel.walk(mine[0, 1:], logits, anchor, 0.0, None)
        rpath, rcands, _ = rsel.select(theirs[:, 1:], logits[None], anchor, 0.0)
        for t in range(cands.shape[0]):
            s = sel.scores(prev, unary[t], succ[t], proj[t])
            rs = unary[t] + torch.einsum(
                "r,kr->k",
                rsel.predecessor_codebook(rprev)[0] * rproj[0, t],
                rsel.successor_codebook(cands[t]),
            )
            torch.testing.assert_close(s, rs, atol=1e-5, rtol=1e-5)
            prev = rprev = path[t : t + 1]
        assert path.tolist() == rpath[0].tolist()
    assert mod.DFlash2DraftModel is type(ref)


def test_reference_saves_load_in_ours(tmp_path, target):
    """A drafter saved by the reference class (codebooks spelled with `.weight`) loads and drafts the same."""
    drafter = tiny_dflash2(target, seed=8)
    save_drafter(drafter, tmp_path / "ours")
    ref = load_reference_drafter(tmp_path / "ours", dflash2=True)
    ref.save_pretrained(str(tmp_path / "theirs"), safe_serialization=True)
    back = load_drafter(tmp_path / "theirs")
    assert type(back) is DFlash2Drafter and back.cfg.dflash2 == drafter.cfg.dflash2
    for name, t in drafter.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], t, atol=0, rtol=0)


# ---- strict loading: every problem is refused by name, exit code 2 ---------------------------------------
def test_dflash2_tensors_under_a_dflash_config_are_refused(tmp_path, target):
    drafter = tiny_dflash2(target)
    save_drafter(drafter, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    raw["architectures"] = ["DFlashDraftModel"]
    for key in PARAMS:
        raw["dflash_config"].pop(key)
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        DrafterFormatError,
        match=r"not used by dflash: candidate_selector\.hidden_projection\.weight, .* and 7 more$",
    ) as err:
        load_drafter(tmp_path / "d")
    assert err.value.exit_code == 2 and "DFlash2DraftModel" in err.value.hint


def test_missing_and_extra_tensors_are_named(tmp_path, target):
    drafter = tiny_dflash2(target)
    save_drafter(drafter, tmp_path / "d")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    state.pop("candidate_selector.successor_codebook")
    state["candidate_selector.bias"] = torch.zeros(3)
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(DrafterFormatError) as err:
        load_drafter(tmp_path / "d")
    assert "missing candidate_selector.successor_codebook" in str(err.value)
    assert "not used by dflash2: candidate_selector.bias" in str(err.value)


def test_non_finite_weights_are_refused(tmp_path, target):
    drafter = tiny_dflash2(target)
    with torch.no_grad():
        drafter.layers[1].mlp_conv.base_kernel[0, 0, 3] = float("nan")
    save_drafter(drafter, tmp_path / "d")
    with pytest.raises(Exception, match="layers.1.mlp_conv.base_kernel' holds NaN"):
        load_drafter(tmp_path / "d")


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda r: r.update(architectures=["EagleDraftModel"]),
            "unknown drafter architecture EagleDraftModel",
        ),
        (lambda r: r["dflash_config"].pop("selector_rank"), "missing selector_rank"),
        (lambda r: r["dflash_config"].update(conv_group_size=7), "conv_group_size 7 does not divide"),
        (lambda r: r["dflash_config"].update(selector_top_k=0), "selector_top_k must be a positive integer"),
        (
            lambda r: r["dflash_config"].update(selector_top_k=2.5),
            "selector_top_k must be a positive integer",
        ),
        (lambda r: r["dflash_config"].update(selector_top_k=VOCAB + 1), "exceeds the vocabulary"),
        (lambda r: r["dflash_config"].update(markov_head_type="gated"), "DSpark"),
        (lambda r: r["dflash_config"].update(mask_token_id="two"), "mask_token_id must be an integer"),
        (lambda r: r["dflash_config"].update(target_layer_ids=[-1, 2]), "must be >= 0, got -1"),
        (
            lambda r: r["dflash_config"].update(output_multiplier=float("nan")),
            "output_multiplier must be a finite",
        ),
    ],
)
def test_bad_configs_are_refused_by_name(target, change, message):
    raw = dflash2_config(target)
    change(raw)
    with pytest.raises((DrafterFormatError, ConfigError), match=message):
        normalize_draft_config(raw)


def test_integral_floats_read_as_integers_as_elsewhere(target):
    raw = dflash2_config(target)
    top_k = raw["dflash_config"]["selector_top_k"]
    raw["dflash_config"]["selector_top_k"] = float(top_k)
    assert normalize_draft_config(raw).dflash2.selector_top_k == top_k


def test_top_level_dialect_and_arch_variants(target):
    """SpecForge / speculators-style exports keep the DFlash 2 keys at the top level; JetSpec sets causal."""
    raw = draft_config_dict(target)
    raw.update(architectures=["DFlash2DraftModel"], **PARAMS)
    cfg = normalize_draft_config(raw)
    assert cfg.arch == "dflash2" and cfg.dflash2 == DFlash2Params(2, 16, 8, 4) and cfg.variant == "dflash2"
    jet = draft_config_dict(target)
    jet["dflash_config"]["causal"] = True
    assert normalize_draft_config(jet).variant == "dflash (in-block causal)"


def test_saved_config_round_trips(tmp_path, target):
    drafter = tiny_dflash2(target, output_multiplier=0.5, final_logit_softcapping=20.0)
    save_drafter(drafter, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in PARAMS} == PARAMS
    cfg = load_draft_config(tmp_path / "d")
    assert (
        cfg.output_multiplier == 0.5
        and cfg.final_logit_softcapping == 20.0
        and cfg.dflash2 == drafter.cfg.dflash2
    )


def test_last_choice_names_the_architecture(target):
    from dflash_zoo.api import Pipeline

    pipe = Pipeline(model=target, drafter=tiny_dflash2(target), mask_token_id=VOCAB - 1)
    pipe.generate([5, 6, 7], max_new_tokens=4)
    assert pipe.last_choice.drafter == "dflash2"
