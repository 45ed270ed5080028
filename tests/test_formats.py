"""Drafter layouts (dflash_zoo/formats): speculators and transformers' native assistant, read strictly.

- transformers' `MuseGlimmerAssistantModel` and our drafter compute the same thing on random weights (fp32,
  1e-5), both ways: its checkpoints load in ours, ours written as hf-native load in it; sliding windows whose
  width matters (a context longer than the window), and default / yarn / llama3 rotary. What it would compute
  differently is refused with the reason.
- speculators configs read to the same `DraftConfig` (taps = aux ids - 1, Qwen3Config defaults for what a
  diff-serialised layer config omits, causality from `sliding_window_non_causal`); what is another drafter is
  refused; its verifier copies must equal the pair's target; a reduced draft vocabulary drafts through its own
  head mapped by `d2t`, losslessly.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from dflash_zoo.adapters import get_adapter
from safetensors.torch import load_file, save_file

from dflash_zoo.engine.checkpoint import load_drafter, save_drafter
from dflash_zoo.engine.config import load_draft_config, normalize_draft_config
from dflash_zoo.engine.decode import EagerEngine
from dflash_zoo.engine.drafter import DFlashDrafter, DraftKV, Span
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.errors import CheckpointError, ConfigError, DrafterFormatError, IncompatiblePairError
from dflash_zoo.formats import HF_NATIVE, SPECULATORS, detect, speculators
from dflash_zoo.formats.draft_vocab import ReducedVocabDrafter
from dflash_zoo.formats.verifier import model_parts
from dflash_zoo.formats.write import Verifier, save_layout
from dflash_zoo.loading import check_pair
from tests.tiny import VOCAB, draft_config_dict, tiny_dflash2, tiny_target

FIXTURES = Path(__file__).parent / "fixtures" / "formats"
MGA = pytest.importorskip("transformers").MuseGlimmerAssistantModel


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=0)


def randomized(model, seed: int, scale: float = 0.2):
    """Every weight moved off its init (norms included), so a swapped or skipped tensor shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model.float().eval()


def bidirectional(target, sliding: bool, rope: dict | None = None, seed: int = 3) -> DFlashDrafter:
    extra = {"rms_norm_eps": 1e-5}
    if sliding:
        extra.update(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    if rope:
        extra["rope_parameters"] = rope
    raw = draft_config_dict(target, **extra)
    raw["dflash_config"]["causal"] = False
    return randomized(DFlashDrafter(normalize_draft_config(raw)), seed)


def mga_forward(model, emb, ctx):
    """transformers' assistant on a fresh DFlashCache told of the context, as its generator calls it."""
    from transformers.cache_utils import DFlashCache

    c = ctx.shape[1]
    cache = DFlashCache(config=model.config)
    cache.set_previous_accepted_tokens(c)
    positions = torch.arange(c + emb.shape[1])[None]
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.17
    out = model(noise_embeds=emb, context_hidden_states=ctx, position_ids=positions, **{name: cache})
    return out.last_hidden_state


def our_forward(drafter, emb, ctx):
    c, n = ctx.shape[1], emb.shape[1]
    return drafter(emb, ctx, Span(q_pos=torch.arange(c, c + n), ctx_pos=torch.arange(c)), DraftKV())


def inputs(drafter, context: int = 13, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cfg = drafter.cfg
    ctx = torch.randn(1, context, cfg.num_taps * cfg.hidden_size, generator=gen)
    return torch.randn(1, cfg.block_size, cfg.hidden_size, generator=gen), ctx


ROPES = [
    None,
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
]  # fmt: skip


# ---- transformers' native assistant ------------------------------------------------------------------------
@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("rope", ROPES, ids=["default", "yarn", "llama3"])
def test_ours_written_as_hf_native_runs_the_same_in_transformers(tmp_path, target, sliding, rope):
    drafter = bidirectional(target, sliding, rope)
    save_layout(drafter, HF_NATIVE, tmp_path / "a")
    theirs = MGA.from_pretrained(str(tmp_path / "a"), dtype=torch.float32).eval()
    emb, ctx = inputs(drafter)  # 13 context tokens: wider than the window of 5
    with torch.no_grad():
        torch.testing.assert_close(
            our_forward(drafter, emb, ctx), mga_forward(theirs, emb, ctx), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("sliding", [False, True])
def test_transformers_assistant_loads_in_ours_and_runs_the_same(tmp_path, sliding):
    from transformers import MuseGlimmerAssistantConfig

    layer_types = ["sliding_attention", "full_attention"] if sliding else ["full_attention"] * 2
    config = MuseGlimmerAssistantConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=4, layer_types=layer_types, target_layer_ids=[0, 2], block_size=8,
        mask_token_id=255, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(5)
    theirs = randomized(MGA(config), seed=6)
    theirs.save_pretrained(str(tmp_path / "a"))
    ours = load_drafter(tmp_path / "a")
    assert ours.cfg.layout == HF_NATIVE and ours.cfg.causal == (False, False)
    assert ours.cfg.sliding_window == (5 if sliding else None)  # |q - k| <= 4 is a distance < 5
    emb, ctx = inputs(ours, context=11, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(
            our_forward(ours, emb, ctx), mga_forward(theirs, emb, ctx), atol=1e-5, rtol=1e-5
        )


def test_the_window_conversion_is_what_makes_them_equal(tmp_path, target):
    """The same sliding layer with transformers' window taken as ours (no + 1) differs: the test can fail."""
    drafter = bidirectional(target, sliding=True)
    save_layout(drafter, HF_NATIVE, tmp_path / "a")
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    raw["sliding_window"] += 1
    (tmp_path / "a" / "config.json").write_text(json.dumps(raw))
    theirs = MGA.from_pretrained(str(tmp_path / "a"), dtype=torch.float32).eval()
    emb, ctx = inputs(drafter)
    with torch.no_grad():
        assert (our_forward(drafter, emb, ctx) - mga_forward(theirs, emb, ctx)).abs().max() > 1e-2


def test_published_assistant_config_reads_as_bidirectional_dflash():
    raw = json.loads((FIXTURES / "muse-glimmer-assistant.json").read_text())
    assert detect(raw) == HF_NATIVE
    cfg = normalize_draft_config(raw)
    assert (cfg.arch, cfg.layout, cfg.block_size, cfg.mask_token_id) == ("dflash", HF_NATIVE, 16, 201818)
    assert cfg.target_layer_ids == (1, 13, 25, 37, 49) and cfg.causal == (False,) * 5
    assert cfg.sliding_window == 2049 and cfg.layer_types == ("sliding_attention",) * 5
    assert (cfg.rope.theta, cfg.rms_norm_eps, cfg.vocab_size, cfg.head_dim) == (500000.0, 1e-5, 202048, 128)


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda t: tiny_dflash2(t), "dflash2 drafter"),
        (lambda t: DFlashDrafter(normalize_draft_config(draft_config_dict(t, attention_bias=True))), "biases"),
        (lambda t: DFlashDrafter(normalize_draft_config(draft_config_dict(
            t, layer_types=["sliding_attention", "full_attention"], sliding_window=6))), "causal"),
        (lambda t: DFlashDrafter(normalize_draft_config(draft_config_dict(t, output_multiplier=0.5))), "logits"),
    ],
    ids=["dflash2", "bias", "causal-sliding", "multiplier"],
)  # fmt: skip
def test_what_the_assistant_computes_otherwise_is_refused(tmp_path, target, make, reason):
    with pytest.raises(
        DrafterFormatError, match=f"MuseGlimmerAssistantModel cannot express.*{reason}"
    ) as err:
        save_layout(make(target), HF_NATIVE, tmp_path / "a")
    assert err.value.exit_code == 2 and not (tmp_path / "a").exists()


def test_hf_native_tensors_are_consumed_strictly(tmp_path, target):
    save_layout(bidirectional(target, sliding=False), HF_NATIVE, tmp_path / "a")
    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    state.pop("encoder.output_norm_enc.weight")
    state["encoder.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(
        DrafterFormatError, match=r"missing hidden_norm\.weight; not used by dflash: encoder\.extra"
    ):
        load_drafter(tmp_path / "a")


@pytest.mark.parametrize("layout", ["zlab", HF_NATIVE])
def test_a_tensor_stored_twice_is_refused_naming_both(tmp_path, target, layout):
    """Two stored tensors landing on one drafter name (with and without the `model.` prefix, in two shards,
    or in hf-native and z-lab spelling): loading either would ignore the other, so it is refused."""
    drafter = bidirectional(target, sliding=False)
    if layout == HF_NATIVE:
        save_layout(drafter, HF_NATIVE, tmp_path / "a")
        stray, twin = "fc.weight", "encoder.fc.weight"
    else:
        save_drafter(drafter, tmp_path / "a")
        stray, twin = "model.fc.weight", "fc.weight"
    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    state[stray] = torch.zeros_like(state[twin])
    save_file(state, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(DrafterFormatError if layout == HF_NATIVE else CheckpointError) as err:
        load_drafter(tmp_path / "a")
    assert stray in str(err.value) and twin in str(err.value)


def test_a_tensor_in_two_shards_is_refused(tmp_path, target):
    save_drafter(bidirectional(target, sliding=False), tmp_path / "a")
    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    (tmp_path / "a" / "model.safetensors").unlink()
    names = sorted(state)
    save_file({k: state[k] for k in names[:3]}, str(tmp_path / "a" / "model-00001-of-00002.safetensors"))
    rest = {k: state[k] for k in names[2:]}  # names[2] in both shards
    save_file(rest, str(tmp_path / "a" / "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match=f"are both the tensor {names[2]}"):
        load_drafter(tmp_path / "a")


# ---- speculators -------------------------------------------------------------------------------------------
def test_speculators_config_reads_like_the_zlab_one():
    """speculators' converter output for z-lab/Qwen3-8B-DFlash-b16 normalises to the z-lab config's values."""
    spec = normalize_draft_config(json.loads((FIXTURES / "speculators-qwen3-8b-dflash.json").read_text()))
    zlab = load_draft_config(Path(__file__).parent / "fixtures" / "configs" / "qwen3-8b" / "draft.json")
    assert spec.layout == SPECULATORS and zlab.layout == "zlab"
    assert spec.target_layer_ids == zlab.target_layer_ids == (1, 9, 17, 25, 33)
    assert (spec.head_dim, spec.vocab_size, spec.rope.theta) == (
        128,
        151936,
        1e6,
    )  # Qwen3Config defaults fill in
    same = (
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "block_size",
        "mask_token_id",
        "causal",
    )
    assert all(getattr(spec, k) == getattr(zlab, k) for k in same)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"sample_from_anchor": True}, "sample_from_anchor=true"),
        ({"projector_type": "domino"}, "correction head"),
        ({"aux_hidden_state_layer_ids": [0, 10]}, r"\[0\]: each must be >= 1"),
        ({"target_hidden_size": 2048}, "target_hidden_size 2048 != hidden_size 4096"),
        ({"speculators_model_type": "eagle3"}, "'eagle3' is not a DFlash drafter"),
        ({"draft_vocab_size": 32000, "speculators_model_type": "dflash2", "conv_kernel_size": 2,
          "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}, "dflash drafters only"),
    ],
)  # fmt: skip
def test_speculators_configs_of_other_drafters_are_refused(change, message):
    raw = {**json.loads((FIXTURES / "speculators-qwen3-8b-dflash.json").read_text()), **change}
    with pytest.raises((DrafterFormatError, ConfigError), match=message):
        normalize_draft_config(raw)


def test_speculators_causality_follows_sliding_window_non_causal(target):
    cfg = normalize_draft_config(draft_config_dict(target, layer_types=["sliding_attention", "full_attention"],
                                                   sliding_window=6))  # fmt: skip
    raw = speculators.from_draft(cfg, {"name_or_path": "t", "architectures": []})
    assert raw["sliding_window_non_causal"] is False and normalize_draft_config(raw).causal == (True, False)
    raw["sliding_window_non_causal"] = True
    assert normalize_draft_config(raw).causal == (False, False)
    del raw["sliding_window_non_causal"]
    raw["speculators_model_type"] = "dflash2"  # its default is non-causal
    raw.update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    assert normalize_draft_config(raw).causal == (False, False)


def verifier_of(model) -> Verifier:
    parts = {k: v.detach().clone() for k, v in model_parts(model, "model.norm").items()}
    return Verifier("tiny/target", ("Qwen3ForCausalLM",), parts)


def test_verifier_copies_must_equal_the_targets(tmp_path, target):
    drafter = bidirectional(target, sliding=False)
    save_layout(drafter, SPECULATORS, tmp_path / "s", verifier_of(target))
    loaded = load_drafter(tmp_path / "s")
    assert {c.name for c in loaded.verifier_copies} == {
        "embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"
    }  # fmt: skip
    check_pair(target, loaded)  # its own target: every copy equal
    other = tiny_target("qwen3", seed=1)
    with pytest.raises(
        IncompatiblePairError, match=r"verifier embedding \(embed_tokens\.weight.*another target"
    ):
        check_pair(other, loaded)


def test_speculators_extra_or_missing_tensors_are_named(tmp_path, target):
    save_layout(bidirectional(target, sliding=False), SPECULATORS, tmp_path / "s", verifier_of(target))
    state = load_file(str(tmp_path / "s" / "model.safetensors"))
    state.pop("fc.weight")
    state["t2d"] = torch.ones(VOCAB, dtype=torch.bool)  # a vocabulary map on a full-vocabulary drafter
    save_file(state, str(tmp_path / "s" / "model.safetensors"))
    with pytest.raises(DrafterFormatError, match=r"missing fc\.weight; not used by dflash: t2d"):
        load_drafter(tmp_path / "s")


# ---- a reduced draft vocabulary ----------------------------------------------------------------------------
KEEP = torch.arange(0, VOCAB, 2)  # the draft vocabulary: every even target id (128 of 256)


def reduced_drafter(target, seed: int = 4) -> ReducedVocabDrafter:
    raw = draft_config_dict(target)
    raw["dflash_config"]["draft_vocab_size"] = len(KEEP)
    model = randomized(ReducedVocabDrafter(normalize_draft_config(raw)), seed, scale=0.05)
    with torch.no_grad():
        model.d2t.copy_(KEEP - torch.arange(len(KEEP)))
        model.lm_head.weight.copy_(target.get_output_embeddings().weight[KEEP])  # as speculators fills it
    return model


def test_reduced_vocabulary_drafts_within_it_and_stays_lossless(tmp_path, target):
    save_layout(reduced_drafter(target), SPECULATORS, tmp_path / "s", verifier_of(target))
    drafter = load_drafter(tmp_path / "s")
    assert type(drafter) is ReducedVocabDrafter and drafter.cfg.draft_vocab_size == len(KEEP)
    assert not drafter.static_supported  # the static engine projects through the target's head
    check_pair(target, drafter)  # the head copy covers the draft vocabulary's rows only
    h = torch.randn(3, drafter.cfg.hidden_size)
    logits = drafter.draft_logits(h, head=None)  # [3, V]
    torch.testing.assert_close(logits[:, KEEP], drafter.lm_head(h))
    assert torch.isinf(logits[:, 1::2]).all()
    best_kept = KEEP[
        target.get_output_embeddings()(h)[:, KEEP].argmax(-1)
    ]  # the target's best draft-vocab id
    assert logits.argmax(-1).tolist() == best_kept.tolist()
    engine = EagerEngine(get_adapter("qwen3")(target), drafter, drafter.cfg.mask_token_id)
    cfg = GenerationConfig(max_new_tokens=40)
    for prompt in ([4, 8, 15, 16], [200, 17, 3]):
        spec, plain = engine.speculative(prompt, cfg), engine.autoregressive(prompt, cfg)
        assert spec.output_ids == plain.output_ids
        assert all(t % 2 == 0 for s in spec.steps for t in s.proposed)


def test_vocabulary_maps_must_agree(tmp_path, target):
    save_layout(reduced_drafter(target), SPECULATORS, tmp_path / "s", verifier_of(target))
    state = load_file(str(tmp_path / "s" / "model.safetensors"))
    state["t2d"][1] = True  # one id more than d2t maps to
    save_file(state, str(tmp_path / "s" / "model.safetensors"))
    with pytest.raises(DrafterFormatError, match="t2d does not mark exactly the target ids d2t maps to"):
        load_drafter(tmp_path / "s")


@pytest.mark.parametrize("layout", ["zlab", HF_NATIVE])
def test_a_reduced_vocabulary_is_refused_where_the_layout_has_none(tmp_path, target, layout):
    with pytest.raises(DrafterFormatError, match="reduced draft vocabulary|whole vocabulary"):
        save_layout(reduced_drafter(target), layout, tmp_path / "x")


def test_zlab_files_are_read_as_before(tmp_path, target):
    """The z-lab path is unchanged: a saved drafter reads back as the same config and tensors."""
    drafter = tiny_dflash2(target, seed=2)
    save_drafter(drafter, tmp_path / "d")
    back = load_drafter(tmp_path / "d")
    assert back.cfg == drafter.cfg and back.cfg.layout == "zlab" and back.verifier_copies == ()
