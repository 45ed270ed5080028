"""Bench shapes (bench/shapes.py) and the MoE roofline rule (bench/meta.py): meta device, tiny CPU models.

Every shape builds on `meta` (no memory, no download), has its model card's parameter count, fits one H200 in
bf16, and its drafter has the published drafter's size and fingerprint (registry.yaml). The MoE streamed bytes
are checked against brute-force counts of routed experts.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from dflash_zoo.adapters import get_adapter

from dflash_zoo.bench import meta as benchmeta
from dflash_zoo.bench.shapes import SHAPES, Shape, shape_drafter, shape_target
from dflash_zoo.engine.config import default_target_layer_ids

H200_BYTES = 141e9  # one H200's HBM3e (141 GB)
REAL = [name for name in SHAPES if not name.startswith("tiny-")]

# Total parameters (billions) as each model card states them, and the tolerance the card's rounding allows:
# +-0.5 where the card gives whole billions ("9B"), +-0.1 where it gives one decimal ("8.2B"). VLM cards
# (Qwen3.5/3.6, Gemma 4) are matched by the text model alone (the bench builds no vision tower).
PUBLISHED = {
    "qwen3-8b": (8.2, 0.1),  # Qwen/Qwen3-8B model card: 8.2B
    "qwen3-4b": (4.0, 0.1),  # Qwen/Qwen3-4B model card: 4.0B
    "llama-3.1-8b": (8.0, 0.5),  # meta-llama/Llama-3.1-8B-Instruct model card: 8B
    "qwen3.5-9b": (9.0, 0.5),  # Qwen/Qwen3.5-9B model card: 9B
    "qwen3-coder-30b-a3b": (30.5, 0.1),  # Qwen/Qwen3-Coder-30B-A3B-Instruct model card: 30.5B total
    "qwen3-32b": (32.8, 0.1),  # Qwen/Qwen3-32B model card: 32.8B
    "qwen3.5-4b": (4.0, 0.5),  # Qwen/Qwen3.5-4B model card: 4B
    "qwen3.5-27b": (27.0, 0.5),  # Qwen/Qwen3.5-27B model card: 27B
    "qwen3.6-27b": (27.0, 0.5),  # Qwen/Qwen3.6-27B model card: 27B
    "qwen3.5-35b-a3b": (35.0, 0.5),  # Qwen/Qwen3.5-35B-A3B model card: 35B total
    "qwen3.6-35b-a3b": (35.0, 0.5),  # Qwen/Qwen3.6-35B-A3B model card: 35B total
    "gpt-oss-20b": (21.0, 0.5),  # openai/gpt-oss-20b model card: 21B total (3.6B active)
    "gemma-4-31b-it": (30.7, 0.1),  # Gemma 4 model card: 31B dense, 30.7B
    "gemma-4-26b-a4b-it": (25.2, 0.1),  # Gemma 4 model card: 26B A4B, 25.2B total (3.8B active)
    "qwen3.8-27b": (27.0, 0.5),  # Qwen/Qwen3.8-27B: 27B (the recipe's 55.56 GB of bf16 weights, with vision)
    # 29.6B with its vision tower (registry.yaml's source); the tower here is the config class default, +-0.2
    "muse-glimmer-30b": (29.6, 0.2),
    "gemma4-12b-it": (12.0, 0.5),  # google/gemma-4-12B-it: 12B (its name and the Hub's count; no card figure)
    "laguna-xs-2.1": (33.0, 0.5),  # vllm-project/recipes#608: Laguna-XS-2.1 is 33B total (3B active)
}
# Active parameters (billions) per token of the MoE cards. Cards differ in whether they count the input
# embedding table, which a decode step does not stream (one row is read), hence +-0.35 (Qwen3-Coder's table
# is 0.31B): the roofline's one-token bytes over 2 must land there.
ACTIVE = {
    "qwen3-coder-30b-a3b": 3.3,  # model card: 3.3B activated
    "qwen3.5-35b-a3b": 3.0,  # model card: 3B activated
    "qwen3.6-35b-a3b": 3.0,  # model card: 3B activated
    "gpt-oss-20b": 3.6,  # model card: 3.6B active
    "gemma-4-26b-a4b-it": 3.8,  # Gemma 4 model card: 3.8B active
    # not Laguna-XS-2.1 ("3B active"): its heads are the config class default, and the shape streams 2.56B
}
# the registry entry each shape benchmarks (qwen3-32b is a capacity shape with no published drafter)
REGISTRY_SLUG = {
    "qwen3-8b": "qwen3-8b",
    "qwen3-4b": "qwen3-4b",
    "llama-3.1-8b": "llama3.1-8b-instruct",
    "qwen3.5-9b": "qwen3.5-9b",
    "qwen3-coder-30b-a3b": "qwen3-coder-30b-a3b",
    "qwen3.5-4b": "qwen3.5-4b",
    "qwen3.5-27b": "qwen3.5-27b",
    "qwen3.6-27b": "qwen3.6-27b",
    "qwen3.5-35b-a3b": "qwen3.5-35b-a3b",
    "qwen3.6-35b-a3b": "qwen3.6-35b-a3b",
    "gpt-oss-20b": "gpt-oss-20b",
    "gemma-4-31b-it": "gemma4-31b-it",
    "gemma-4-26b-a4b-it": "gemma4-26b-a4b-it",
    "qwen3.8-27b": "qwen3.8-27b",
    "muse-glimmer-30b": "muse-glimmer-30b",
    "gemma4-12b-it": "gemma4-12b-it",
    "laguna-xs-2.1": "laguna-xs-2.1",
}
# the shape's drafter is the older upload (5 layers, 5 taps), not the one the registry describes at `main`
OLDER_DRAFTER = {"qwen3.5-9b"}


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def built():
    """Every real shape's target and drafter on the meta device, and their streamed bytes (bf16)."""
    out = {}
    for name in REAL:
        s = SHAPES[name]
        target, drafter = shape_target(s, "meta", torch.bfloat16), shape_drafter(s, "meta", torch.bfloat16)
        wb = benchmeta.weight_bytes(get_adapter(s.model_type)(target), drafter, s.block_size)
        out[name] = (target, drafter, wb)
    return out


def test_every_shape_has_a_published_size():
    assert set(PUBLISHED) == set(REAL)


@pytest.mark.parametrize("name", REAL)
def test_shape_builds_on_meta_with_its_published_parameter_count(built, name):
    target, drafter, _ = built[name]
    assert all(p.is_meta for p in target.parameters()) and all(p.is_meta for p in drafter.parameters())
    published, tol = PUBLISHED[name]
    assert abs(_params(target) / 1e9 - published) <= tol, (name, _params(target))


@pytest.mark.parametrize("name", REAL)
def test_shape_fits_one_h200_in_bf16(built, name):
    _, _, wb = built[name]
    assert wb["target_total"] + wb["drafter"] < H200_BYTES, name


@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_moe_shape_streams_its_active_parameters_per_token(built, name):
    """One token's streamed bytes (k of E experts, dense parts, head) are the card's active parameters."""
    _, _, wb = built[name]
    assert abs(wb["target_streamed"] / 2e9 - ACTIVE[name]) <= 0.35, (name, wb["target_streamed"])
    s = SHAPES[name]
    experts, top_k = benchmeta.moe_routing(built[name][0].config)
    assert (experts, top_k) != (0, 0)
    assert wb["target_streamed"] < wb["target_streamed_verify"] < wb["target_total"]
    assert s.block_size > 1


@pytest.mark.parametrize("name", [n for n in REAL if n in REGISTRY_SLUG])
def test_drafter_matches_the_registry_fingerprint_and_published_size(built, name):
    from dflash_zoo.zoo.registry import load_registry

    entry = load_registry().resolve(REGISTRY_SLUG[name])
    s, (target, drafter, wb) = SHAPES[name], built[name]
    text = target.config.get_text_config()  # a VLM wrapper (muse_glimmer) nests it
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (
        entry.target.hidden_size,
        entry.target.num_hidden_layers,
        entry.target.vocab_size,
    )
    cfg = drafter.cfg
    assert cfg.hidden_size == s.hidden and cfg.block_size == s.block_size == entry.draft.block_size
    assert cfg.target_layer_ids == (
        s.draft_tap_ids or tuple(default_target_layer_ids(s.layers, s.draft_taps))
    )
    assert cfg.arch == (entry.draft.architecture or "dflash")
    if entry.draft.mask_token_id is not None:
        assert cfg.mask_token_id == entry.draft.mask_token_id
    if name in OLDER_DRAFTER:
        return
    assert cfg.num_hidden_layers == entry.draft.num_layers
    assert cfg.target_layer_ids == entry.draft.target_layer_ids
    # the registry's size is the published one in GiB to two decimals
    assert abs(wb["drafter"] / 2**30 - entry.draft_size_bytes / 2**30) <= 0.006, (name, wb["drafter"])


def test_family_structure_of_the_new_shapes(built):
    """The family fields reach the modules: hybrid GDN layers, gpt-oss's experts and sinks, Gemma 4's
    global layers with their own head dim and K = V, and the MoE block beside the dense MLP."""
    q27 = built["qwen3.5-27b"][0]
    types = q27.config.layer_types
    assert types.count("full_attention") == 16 and types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    gdn = q27.model.layers[0].linear_attn
    assert gdn.in_proj_qkv.weight.shape == (2 * 16 * 128 + 48 * 128, 5120)  # q, k: 16 heads; v: 48 heads
    assert gdn.conv1d.weight.shape[-1] == 4
    assert q27.config.rope_parameters["partial_rotary_factor"] == 0.25
    assert q27.config.rope_parameters["rope_theta"] == 1e7

    moe = built["qwen3.5-35b-a3b"][0].model.layers[0].mlp
    assert moe.experts.gate_up_proj.shape == (256, 2 * 512, 2048)
    assert moe.shared_expert.down_proj.weight.shape == (2048, 512)

    oss = built["gpt-oss-20b"][0]
    assert oss.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert oss.config.sliding_window == 128
    assert oss.config._attn_implementation == "eager"  # attention sinks
    assert oss.model.layers[0].mlp.experts.gate_up_proj.shape == (32, 2880, 2 * 2880)
    assert oss.config.rope_parameters["rope_type"] == "yarn" and oss.config.rope_parameters["factor"] == 32.0
    assert oss.get_input_embeddings().weight is not oss.get_output_embeddings().weight

    g31 = built["gemma-4-31b-it"][0]
    assert g31.config.layer_types.count("full_attention") == 10
    full, sliding = g31.model.layers[5].self_attn, g31.model.layers[0].self_attn
    assert full.k_proj.weight.shape == (4 * 512, 5376) and full.v_proj is None  # K = V on global layers
    assert sliding.k_proj.weight.shape == (16 * 256, 5376)
    assert g31.config.final_logit_softcapping == 30.0 and g31.config.hidden_size_per_layer_input == 0
    assert g31.get_input_embeddings().weight is g31.get_output_embeddings().weight
    g26 = built["gemma-4-26b-a4b-it"][0].model.layers[0]
    assert g26.experts.gate_up_proj.shape == (128, 2 * 704, 2816)  # routed experts, beside the dense MLP
    assert g26.mlp.down_proj.weight.shape == (2816, 2112)
    assert benchmeta.moe_routing(built["gemma-4-26b-a4b-it"][0].config) == (128, 8)  # top_k_experts

    d = built["gpt-oss-20b"][1].cfg
    assert (d.head_dim, d.attention_bias, d.num_hidden_layers, d.rope.type) == (64, True, 8, "yarn")
    g = built["gemma-4-31b-it"][1].cfg
    assert g.layer_types == ("sliding_attention",) * 4 + ("full_attention",) and g.sliding_window == 2048
    assert g.final_logit_softcapping == 30.0 and g.num_attention_heads == 64


def test_gemma4_12b_and_laguna_xs_shapes(built):
    """Gemma 4 12B is the whole `gemma4_unified` wrapper (one K = V head of 512 on its 8 full layers) with a plain
    DFlash drafter; Laguna-XS-2.1 is a MoE after a dense first layer with its own drafter architecture (a gate
    per head, one norm per tap, causal in the block), the published taps and its byte count."""
    target, drafter, _ = built["gemma4-12b-it"]
    text = target.config.get_text_config()
    assert type(target).__name__ == "Gemma4UnifiedForConditionalGeneration"
    assert text.layer_types.count("full_attention") == 8 and text.final_logit_softcapping == 30.0
    layers = target.model.language_model.layers
    full, sliding = layers[5].self_attn, layers[0].self_attn
    assert full.k_proj.weight.shape == (512, 3840) and full.v_proj is None  # K = V on global layers
    assert sliding.k_proj.weight.shape == (8 * 256, 3840)
    assert target.get_input_embeddings().weight is target.get_output_embeddings().weight
    g = drafter.cfg
    assert (g.arch, g.num_attention_heads, g.intermediate_size, g.rope.theta) == ("dflash", 32, 7680, 1e6)
    assert g.causal == (True,) * 4 + (False,) and g.final_logit_softcapping == 30.0
    assert drafter.fc.weight.shape == (3840, 6 * 3840)

    target, drafter, _ = built["laguna-xs-2.1"]
    assert type(target).__name__ == "LagunaForCausalLM"
    assert target.config.mlp_layer_types[:2] == ["dense", "sparse"]
    moe = target.model.layers[1].mlp
    assert moe.experts.gate_up_proj.shape[0] == 256
    assert moe.shared_experts.down_proj.weight.shape == (2048, 512)
    assert benchmeta.moe_routing(target.config) == (256, 8)
    assert target.config.rope_parameters["full_attention"]["rope_theta"] == 5e5  # the class default
    d = drafter.cfg
    assert (d.arch, d.attention_gate, d.sliding_window) == ("laguna_dflash", "per-head", 512)
    assert d.causal == (True,) * 5 and d.num_attention_heads == 64
    assert d.target_layer_ids == (1, 13, 25, 33, 39) and d.mask_token_id == 12
    assert len(drafter.aux_hidden_norms) == 5
    assert drafter.layers[0].self_attn.g_proj.weight.shape == (64, 2048)
    assert sum(p.numel() for p in drafter.parameters()) == 462_064_896  # 924,135,848 bytes less the header


def test_runner_re_exports_the_shapes():
    from dflash_zoo.bench import runner, shapes

    assert runner.SHAPES is shapes.SHAPES and runner.Shape is shapes.Shape
    assert runner.shape_target is shapes.shape_target and runner.CODER_MOE is shapes.CODER_MOE


def test_random_prompt_avoids_a_low_mask_id():
    """Gemma 4's mask id is 4: the prompt draws from the whole table (never 4), not from ids below 4."""
    from dflash_zoo.bench import runner

    opts = runner.BenchOptions(prompt_tokens=64)
    sub = runner.random_subject("gemma-4-26b-a4b-it", "meta", torch.bfloat16, opts)
    assert 4 not in sub.prompt and max(sub.prompt) > 1000 and sub.mask_token_id == 4
    assert sub.source["draft"]["intermediate_size"] == 5632  # the drafter's shape is in the record


# ---- the MoE roofline: expected distinct experts and streamed bytes -----------------------------------------


def _exact_distinct(experts: int, top_k: int, rows: int) -> Fraction:
    """Mean size of the union of `rows` uniformly drawn top-k sets, by enumerating every draw."""
    subsets = list(itertools.combinations(range(experts), top_k))
    total = sum(len(set().union(*draw)) for draw in itertools.product(subsets, repeat=rows))
    return Fraction(total, len(subsets) ** rows)


@pytest.mark.parametrize("experts,top_k,rows", [(8, 2, 1), (8, 2, 2), (8, 2, 3), (4, 3, 3), (6, 1, 4)])
def test_expected_distinct_experts_equals_enumeration(experts, top_k, rows):
    got = benchmeta.expected_distinct_experts(experts, top_k, rows)
    assert math.isclose(got, _exact_distinct(experts, top_k, rows), rel_tol=1e-12)


def test_expected_distinct_experts_monte_carlo_at_verify_width():
    """128 experts, top 8, a 16-row verify: E (1 - (1 - k/E)^16) = 82.4 experts, sampled with a fixed seed."""
    gen = torch.Generator().manual_seed(0)
    trials = 4000
    scores = torch.rand(trials, 16, 128, generator=gen)
    chosen = torch.zeros(trials, 128, dtype=torch.bool)
    picks = scores.topk(8, dim=-1).indices.flatten(1)  # the top 8 of uniform scores: a uniform 8-set per row
    chosen.scatter_(1, picks, True)
    mean = chosen.sum(1).double().mean().item()
    expected = benchmeta.expected_distinct_experts(128, 8, 16)
    assert abs(mean - expected) < 0.15  # the sample mean's standard error is ~0.04
    assert benchmeta.expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    with pytest.raises(ValueError):
        benchmeta.expected_distinct_experts(4, 5, 1)


def _tiny_moe(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **extra}
    s = Shape("qwen3_moe", 64, 3, 256, 4, 2, 16, 128, 1e6, 255, draft_layers=2, draft_taps=2, extra=moe)
    return shape_target(s, "cpu", torch.float32), shape_drafter(s, "cpu", torch.float32)


def _expert_bytes(model, experts: int) -> dict[int, list[int]]:
    """layer index -> bytes of each of its experts (the `.experts.` tensors are [E, ...])."""
    per_layer: dict[int, list[int]] = {}
    for name, p in model.named_parameters():
        if ".experts." in name:
            assert p.shape[0] == experts
            layer = int(name.split(".layers.")[1].split(".")[0])
            row = per_layer.setdefault(layer, [0] * experts)
            for e in range(experts):
                row[e] += p[e].numel() * p.element_size()
    return per_layer


def test_moe_streamed_bytes_equal_a_brute_force_count():
    """8 experts, top 2, 3 layers: exact over every routing for 1 and 2 rows, Monte-Carlo for an 8-row verify;
    dense parts (attention, router, norms, head) always count."""
    model, drafter = _tiny_moe()
    adapter = get_adapter("qwen3_moe")(model)
    per_layer = _expert_bytes(model, 8)
    total = sum(p.numel() * 4 for p in model.parameters())
    dense = total - model.get_input_embeddings().weight.numel() * 4 - sum(map(sum, per_layer.values()))
    subsets = list(itertools.combinations(range(8), 2))

    def exact(rows: int) -> Fraction:
        out = Fraction(dense)
        for row in per_layer.values():  # layers route independently
            draws = list(itertools.product(subsets, repeat=rows))
            out += Fraction(sum(sum(row[e] for e in set().union(*d)) for d in draws), len(draws))
        return out

    for rows in (1, 2):
        wb = benchmeta.weight_bytes(adapter, drafter, block=rows)
        assert abs(wb["target_streamed_verify"] - exact(rows)) <= 1
    assert benchmeta.weight_bytes(adapter, drafter, block=2)["target_streamed"] == round(exact(1))

    gen = torch.Generator().manual_seed(1)
    trials, rows = 3000, 8
    sampled = 0.0
    for row in per_layer.values():
        picks = torch.rand(trials, rows, 8, generator=gen).topk(2, dim=-1).indices.flatten(1)
        used = torch.zeros(trials, 8, dtype=torch.bool).scatter_(1, picks, True)
        sampled += (used.double() @ torch.tensor(row, dtype=torch.float64)).mean().item()
    wb = benchmeta.weight_bytes(adapter, drafter, block=rows)
    routed = wb["target_streamed_verify"] - dense
    assert abs(sampled - routed) <= 0.01 * routed, (sampled, routed)
    assert wb["drafter"] == sum(p.numel() * 4 for p in drafter.parameters())


def test_gemma4_moe_top_k_is_read_from_top_k_experts():
    """Gemma 4 names its top-k `top_k_experts`: one token streams 2 of 8 experts, not all of them."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    drafter = _tiny_moe()[1]
    wb = benchmeta.weight_bytes(get_adapter("gemma4_text")(model), drafter, block=4)
    experts = sum(sum(row) for row in _expert_bytes(model, 8).values())
    streamed = wb["target_total"] - model.get_input_embeddings().weight.numel() * 4
    assert wb["target_streamed"] == streamed - round(experts * 0.75)
    assert wb["target_streamed_verify"] == streamed - round(experts * 0.75**4)


def test_dense_bytes_do_not_depend_on_the_verify_width():
    s = SHAPES["tiny-qwen3"]
    model, drafter = shape_target(s, "cpu", torch.float32), shape_drafter(s, "cpu", torch.float32)
    adapter = get_adapter("qwen3")(model)
    embedding = model.get_input_embeddings().weight.numel() * 4  # untied: not streamed
    everything = sum(p.numel() * 4 for p in model.parameters()) - embedding
    for block in (1, 8, 16):
        wb = benchmeta.weight_bytes(adapter, drafter, block=block)
        assert wb["target_streamed"] == wb["target_streamed_verify"] == everything


def test_tied_and_untied_heads_are_told_apart_on_meta(built):
    """On `meta` every data_ptr() is 0: the tied check must not take an untied head for a tied one."""
    tied, untied = built["qwen3-4b"], built["qwen3-8b"]
    assert tied[2]["target_streamed"] == tied[2]["target_total"]
    emb = untied[0].get_input_embeddings().weight
    assert untied[2]["target_streamed"] == untied[2]["target_total"] - emb.numel() * 2


def test_dflash2_shapes_build_their_drafters(built):
    """The DFlash 2 pairs: the drafter is `DFlash2DraftModel` with the published sizes (block 8 and taps
    [5, 19, 33, 47, 61] for Qwen3.8-27B), its convolutions and selector in place; Muse-Glimmer's target is the
    whole wrapper (no causal-LM class for its text model) with the scaled, soft-capped logits."""
    for name in ("qwen3.8-27b", "muse-glimmer-30b"):
        drafter = built[name][1]
        cfg = drafter.cfg
        assert cfg.arch == "dflash2" and cfg.dflash2.selector_top_k == 16 and cfg.dflash2.selector_rank == 256
        assert (cfg.dflash2.conv_kernel_size, cfg.dflash2.conv_group_size) == (2, 16)
        assert set(cfg.layer_types) == {"sliding_attention"} and cfg.sliding_window == 2048
        convs = [n for n, _ in drafter.named_parameters() if "kernel_projection" in n]
        assert len(convs) == 2 * cfg.num_hidden_layers  # one before and after attention and MLP each
    q38 = built["qwen3.8-27b"][1].cfg
    assert q38.block_size == 8 and q38.target_layer_ids == (5, 19, 33, 47, 61) and q38.mask_token_id == 248070
    target, drafter, _ = built["muse-glimmer-30b"]
    text = target.config.get_text_config()
    assert type(target).__name__ == "MuseGlimmerForConditionalGeneration" and text.hidden_size == 6656
    assert text.layer_types.count("full_attention") == 13 and text.final_logit_softcapping == 20.0
    assert (
        drafter.cfg.output_multiplier == text.output_multiplier
        and drafter.cfg.final_logit_softcapping == 20.0
    )


def test_draft_arch_rebuilds_a_shapes_drafter_as_another_architecture():
    """`bench --shape S --draft-arch A`: the same drafter layers, with or without DFlash 2's parts."""
    from dflash_zoo.bench.shapes import SHAPES, shape_drafter

    v2 = shape_drafter(SHAPES["qwen3.8-27b"], "meta", torch.bfloat16)
    v1 = shape_drafter(SHAPES["qwen3.8-27b"], "meta", torch.bfloat16, arch="dflash")
    assert (v2.arch, v1.arch) == ("dflash2", "dflash")
    assert set(v1.state_dict()) < set(v2.state_dict()) and v1.cfg.block_size == v2.cfg.block_size == 8
    up = shape_drafter(SHAPES["qwen3-8b"], "meta", torch.bfloat16, arch="dflash2")
    assert up.arch == "dflash2" and up.cfg.dflash2.selector_top_k == 16
    # a drafter of its own architecture (Laguna's) loses its gate and tap norms, keeps its layers and block
    for arch in ("dflash", "dflash2"):
        plain = shape_drafter(SHAPES["laguna-xs-2.1"], "meta", torch.bfloat16, arch=arch)
        assert plain.arch == arch and plain.cfg.attention_gate is None
        assert not hasattr(plain, "aux_hidden_norms")
        assert (plain.cfg.num_hidden_layers, plain.cfg.block_size, plain.cfg.sliding_window) == (5, 16, 512)
