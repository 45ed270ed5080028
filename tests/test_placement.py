"""Multi-device placement (cuda/placement/): the balance rule, the plan's rules, and lossless output once placed.

On CPU the split is ["cpu", "cpu"]: no tensor changes device, but every hook runs, so these tests check the
plan, the module moves and that hooks leave outputs unchanged. A real cross-device run needs two GPUs (marked).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from dflash_zoo.adapters import get_adapter, supported_model_types

from dflash_zoo.api import Pipeline, load
from dflash_zoo.cuda.placement.hooks import apply_placement
from dflash_zoo.cuda.placement.plan import balance, module_bytes, parse_devices, plan_placement
from dflash_zoo.engine.decode import autoregressive_generate
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.engine.select import EngineOptions
from dflash_zoo.errors import ConfigError, UnsupportedModelError
from tests.static_matrix import STATIC_MODEL_TYPES
from tests.tiny import VOCAB, tiny_drafter, tiny_target

SPLIT = ["cpu", "cpu"]


def _prompt(seed: int, n: int = 10) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB - 2) for _ in range(n)]


def _max_load(slots, sizes, extra):
    per = list(extra)
    for s, b in zip(slots, sizes, strict=True):
        per[s] += b
    return max(per)


# ---- balance (unit) --------------------------------------------------------------------------------------
def test_balance_splits_equal_layers_evenly_and_contiguously():
    assert balance([10] * 8, [0, 0]) == [0] * 4 + [1] * 4
    assert balance([10] * 9, [0, 0, 0]) == [0] * 3 + [1] * 3 + [2] * 3


def test_balance_counts_stem_and_head_bytes():
    slots = balance([10] * 8, [30, 0])  # a big embedding on the first device: fewer layers there
    assert slots.count(0) == 2 and _max_load(slots, [10] * 8, [30, 0]) == 60  # 30 + 20 | 60
    assert balance([10] * 8, [0, 40]) == [0] * 6 + [1] * 2


def test_balance_is_the_min_max_partition():
    rng = random.Random(0)
    for _ in range(30):
        sizes = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 8))]
        extra = [rng.randrange(0, 60) for _ in range(rng.randrange(1, 4))]
        slots = balance(sizes, extra)
        assert slots == sorted(slots)  # contiguous ranges, in device order
        best = min(
            _max_load([sum(c <= i for c in cuts) for i in range(len(sizes))], sizes, extra)
            for cuts in itertools.combinations_with_replacement(range(len(sizes) + 1), len(extra) - 1)
        )
        assert _max_load(slots, sizes, extra) == best


# ---- the plan's rules ------------------------------------------------------------------------------------
def test_plan_rules_untied():
    model = tiny_target("qwen3", num_hidden_layers=6)
    adapter = get_adapter("qwen3")(model)
    plan = plan_placement(adapter, SPLIT, reserve_bytes=1000)
    assert not plan.tied and plan.stem_device == 0 and plan.head_device == 1 and plan.head == "cpu"
    assert list(plan.layer_devices) == sorted(plan.layer_devices) and set(plan.layer_devices) == {0, 1}
    assert sum(plan.device_bytes) == module_bytes(model) + 1000
    assert [(a, b) for _, a, b in plan.layer_ranges()] == [(0, 2), (3, 5)]
    assert plan.to_dict()["layer_ranges"][0] == ["cpu", 0, 2]


def test_plan_rules_tied_embeddings_live_with_the_head():
    model = tiny_target("qwen3", tie_word_embeddings=True)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    plan = plan_placement(get_adapter("qwen3")(model), SPLIT)
    assert plan.tied and plan.stem_device == plan.head_device == 1
    assert sum(plan.device_bytes) == module_bytes(model)  # the shared weight is counted once


# ---- bad device strings -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["gpu0", "cuda:0,,cuda:1", "", "meta", "cuda:99", "cpu,tpu"])
def test_bad_device_strings_are_config_errors(spec):
    with pytest.raises(ConfigError):
        parse_devices(spec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_auto_without_gpus_is_a_config_error():
    with pytest.raises(ConfigError, match="auto"):
        parse_devices("auto")


def test_device_and_device_map_together_are_refused():
    model = tiny_target("qwen3")
    with pytest.raises(ConfigError, match="not both"):
        load(model, tiny_drafter(model), device="cpu", device_map=SPLIT)


def test_cli_bad_devices_gives_one_line_error(capsys):
    from dflash_zoo.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--devices", "cpu,bogus"])
    err = capsys.readouterr().err
    # a device list is checked before anything loads: a usage error (exit 2), one line and a hint
    assert exc.value.code == 2 and err.startswith("error: unknown device 'bogus'") and "Traceback" not in err


# ---- placed output equals the unplaced target's greedy output ------------------------------------------
def _placed_pipeline(model_type: str, devices, **overrides) -> tuple[Pipeline, list[list[int]]]:
    """A tiny pair placed over `devices`, plus the unplaced target's AR greedy output for three prompts."""
    model = tiny_target(model_type, seed=0, **overrides)
    drafter = tiny_drafter(model, seed=1, block_size=8)
    cfg = GenerationConfig(max_new_tokens=24)
    refs = [
        autoregressive_generate(get_adapter(model_type)(model), _prompt(s), cfg).output_ids for s in range(3)
    ]
    pipe = load(model, drafter, device_map=devices, dtype="fp32")
    pipe.stop_token_ids = ()  # the references run without stop tokens
    return pipe, refs


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_family_can_be_planned(model_type):
    model = tiny_target(model_type)
    plan = plan_placement(get_adapter(model_type)(model), SPLIT)
    assert len(plan.layer_devices) == get_adapter(model_type)(model).num_layers
    assert sum(plan.device_bytes) == module_bytes(model)


# dense, hybrid GDN (rollback through the hooks), sliding window, MLA
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text", "gemma4_text", "deepseek_v3"])
def test_placed_speculative_greedy_equals_unplaced_autoregressive(model_type):
    pipe, refs = _placed_pipeline(model_type, SPLIT)
    assert pipe.placement is not None and pipe.placement.handles
    hooked = [len(layer._forward_pre_hooks) for layer in pipe.adapter.layers()]
    assert all(n >= 1 for n in hooked)
    for seed, ref in enumerate(refs):
        assert pipe.generate(_prompt(seed), max_new_tokens=24).output_ids == ref
        assert pipe.generate_autoregressive(_prompt(seed), max_new_tokens=24).output_ids == ref


def test_tied_target_placed_and_hooks_removable():
    pipe, refs = _placed_pipeline("qwen3", ["cpu", "cpu", "cpu"], tie_word_embeddings=True)
    emb, head = pipe.model.get_input_embeddings(), pipe.model.get_output_embeddings()
    assert emb.weight is head.weight
    assert pipe.generate(_prompt(0), max_new_tokens=24).output_ids == refs[0]
    pipe.placement.remove()
    assert all(not layer._forward_pre_hooks for layer in pipe.adapter.layers())
    assert not pipe.drafter._forward_pre_hooks


def test_the_final_norm_is_found_through_the_adapter():
    """Placement puts the adapter's `final_norm_path` with the head; a path the model lacks is refused by name."""
    model = tiny_target("qwen3")
    adapter = get_adapter("qwen3")(model)
    assert adapter.final_norm_path() == "model.norm"
    assert sum(plan_placement(adapter, SPLIT).device_bytes) == module_bytes(model)
    moved = type("MovedNorm", (get_adapter("qwen3"),), {"norm_path": "model.final_ln"})
    with pytest.raises(UnsupportedModelError, match="no final norm at model.final_ln"):
        plan_placement(moved(model), SPLIT)


@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_placement_turns_the_fast_path_off(model_type):
    pipe, _ = _placed_pipeline(model_type, SPLIT)
    pipe.options = EngineOptions(fast=True)
    pipe.engine(pipe.config(max_new_tokens=8), 10)
    assert pipe.last_choice.name == "eager" and "split across devices" in pipe.last_choice.reason


def test_apply_placement_refuses_a_plan_for_another_model():
    small, big = tiny_target("qwen3"), tiny_target("qwen3", num_hidden_layers=6)
    plan = plan_placement(get_adapter("qwen3")(big), SPLIT)
    with pytest.raises(ConfigError, match="layers"):
        apply_placement(small, get_adapter("qwen3")(small), plan)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpu_split_is_lossless_fp32():
    for model_type in ("qwen3", "qwen3_5_text"):
        pipe, refs = _placed_pipeline(model_type, ["cuda:0", "cuda:1"])
        layers = pipe.adapter.layers()
        assert {next(layer.parameters()).device.index for layer in layers} == {0, 1}
        assert pipe.device == torch.device("cuda:1")
        for seed, ref in enumerate(refs):
            assert pipe.generate(_prompt(seed), max_new_tokens=24).output_ids == ref


@pytest.mark.parametrize("tied", [False, True])
def test_materialised_random_target_matches_a_directly_built_one(monkeypatch, tied):
    """`materialise` (meta -> planned devices -> HF init): no meta tensor left, rotary tables exact, the tied
    head still tied, weights drawn as `from_config` draws them; and the placed pair decodes losslessly."""
    from dflash_zoo.bench import runner as B
    from dflash_zoo.engine.decode import SpeculativeDecoder, autoregressive_generate
    from dflash_zoo.engine.results import GenerationConfig

    shape = B.SHAPES["tiny-qwen3"]
    if tied:
        shape = B.Shape(**{**vars(shape), "extra": {"tie_word_embeddings": True}})
        monkeypatch.setitem(B.SHAPES, "tiny-tied", shape)
    opts = B.BenchOptions(prompt_tokens=8)
    sub = B.random_subject("tiny-tied" if tied else "tiny-qwen3", "cpu", torch.float32, opts, ["cpu", "cpu"])
    ref = B.shape_target(shape, "cpu", torch.float32)
    model = sub.adapter.model
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
        assert torch.equal(b, rb), name
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert abs(p.std() - rp.std()) <= 0.2 * rp.std() + 1e-6, name  # same init rule (std 0.02, ones, ...)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    assert sub.source["placement"]["tied"] == tied and len(sub.placement.handles) > 0
    cfg = GenerationConfig(max_new_tokens=10, block_size=shape.block_size)
    ar = autoregressive_generate(sub.adapter, sub.prompt, cfg, "cpu").output_ids
    dec = SpeculativeDecoder(sub.adapter, sub.drafter, sub.prompt, cfg, sub.mask_token_id)
    for _ in dec:
        pass
    assert dec.result.output_ids == ar
