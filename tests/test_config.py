"""Draft-config normalisation over every schema generation seen in the wild (docs/method.md §5)."""

from __future__ import annotations

import json

import pytest

from dflash_zoo.engine.config import default_target_layer_ids, load_draft_config, normalize_draft_config
from dflash_zoo.errors import ConfigError

BASE = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
}


@pytest.mark.parametrize(
    "layers,n,expected",
    [(36, 5, [1, 9, 17, 25, 33]), (32, 5, [1, 8, 15, 22, 29]), (64, 5, [1, 16, 31, 46, 61]), (36, 1, [18])],
)
def test_default_taps_follow_upstream_rule(layers, n, expected):
    assert default_target_layer_ids(layers, n) == expected


def test_early_generation_top_level_block_and_default_taps():
    cfg = normalize_draft_config({**BASE, "block_size": 16, "num_target_layers": 36, "rope_theta": 1e6})
    assert cfg.block_size == 16
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.taps_from_default_rule
    assert cfg.mask_token_id is None and cfg.rope.theta == 1e6
    assert cfg.layer_types == ("full_attention",) * 5 and cfg.causal == (False,) * 5


def test_taps_and_mask_in_dflash_config_win_over_top_level():
    raw = {
        **BASE,
        "block_size": 10,
        "dflash_config": {"target_layer_ids": [3, 11, 23, 35, 43], "mask_token_id": 151669},
    }
    cfg = normalize_draft_config(raw)
    assert cfg.target_layer_ids == (3, 11, 23, 35, 43)  # explicit lists are never "corrected"
    assert cfg.mask_token_id == 151669 and cfg.block_size == 10 and not cfg.taps_from_default_rule


def test_transformers5_export_nested_block_rope_parameters_and_sliding_layers():
    raw = {
        **BASE,
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "sliding_window": 4096,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e7,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
        "dflash_config": {
            "block_size": 16,
            "target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29],
            "mask_token_id": 248077,
        },
    }
    cfg = normalize_draft_config(raw)
    assert cfg.block_size == 16 and cfg.num_taps == 8
    assert cfg.rope.type == "yarn" and cfg.rope.factor == 4.0 and cfg.rope.theta == 1e7
    assert cfg.sliding_window == 4096
    assert cfg.causal == (True,) * 5 + (False,)  # sliding layers causal, full layers bidirectional


def test_llama3_rope_scaling_legacy_spelling():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = normalize_draft_config(
        {**BASE, "num_target_layers": 32, "rope_theta": 5e5, "rope_scaling": scaling}
    )
    assert (
        cfg.rope.type == "llama3"
        and cfg.rope.theta == 5e5
        and cfg.rope.original_max_position_embeddings == 8192
    )


@pytest.mark.parametrize(
    "causal,expected", [(True, (True, True)), (False, (False, False)), ([True, False], (True, False))]
)
def test_explicit_causality_overrides_layer_types(causal, expected):
    raw = {**BASE, "num_hidden_layers": 2, "num_target_layers": 36, "dflash_config": {"causal": causal}}
    assert normalize_draft_config(raw).causal == expected


@pytest.mark.parametrize(
    "patch,message",
    [
        ({"block_size": 1}, "block_size must be >= 2"),
        ({"hidden_size": None}, "hidden_size"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ({"layer_types": ["sliding_attention"] * 5}, "sliding_window is not set"),
        ({"layer_types": ["linear_attention"] * 5, "sliding_window": 8}, "unsupported draft layer type"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "unsupported draft rope type"),
        ({"layer_types": 5}, "layer_types must be a list"),
        ({"layer_types": [["full_attention"]] * 5}, "layer_types must be a list"),
        (
            {"layer_types": ["sliding_attention"] * 5, "sliding_window": "big"},
            "sliding_window must be an int",
        ),
        ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": "x"}, "max_window_layers"),
        ({"rope_scaling": 5}, "rope_scaling must be a JSON object"),
        ({"rope_theta": "x"}, "rope_theta"),
    ],
)
def test_bad_configs_get_clear_errors(patch, message):
    raw = {**BASE, "num_target_layers": 36, **patch}
    with pytest.raises(ConfigError, match=message):
        normalize_draft_config(raw)


def test_missing_taps_and_target_layers_is_an_error():
    with pytest.raises(ConfigError, match="neither target_layer_ids nor num_target_layers"):
        normalize_draft_config(BASE)


def test_load_from_directory_and_bad_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "num_target_layers": 36}))
    assert load_draft_config(tmp_path).num_target_layers == 36
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_draft_config(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        load_draft_config(tmp_path / "missing")


@pytest.mark.parametrize("patch", [{"hidden_size": None}, {"architectures": 5}, {"layer_types": 5}])
def test_a_config_files_errors_name_the_file(tmp_path, patch):
    """One line naming the file (a cached config's snapshot tells the revision), never an internal error."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, "num_target_layers": 36, **patch}))
    with pytest.raises(ConfigError) as err:
        load_draft_config(tmp_path)
    assert str(err.value).startswith(f"{path}: ")
