"""Laguna DFlash drafters (`DFlashLagunaForCausalLM`): the forward against an independent oracle written from the
published description, lossless decoding on a Laguna target, the checkpoint layout (fused q/k/v), the config
keys and the layouts that cannot hold it.

No reference package publishes this drafter, so the oracle below computes one drafting pass from the
checkpoint's own tensors (fused `qkv_proj`) over `[context ; block]` with an explicit visibility rule, in fp64,
and our module must match it in fp32, with the context fed at once and in two cached parts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dflash_zoo.adapters import get_adapter
from safetensors.torch import load_file, save_file

from dflash_zoo.drafters.laguna_dflash import LagunaDrafter
from dflash_zoo.engine.checkpoint import load_drafter, save_drafter
from dflash_zoo.engine.config import normalize_draft_config
from dflash_zoo.engine.decode import EagerEngine
from dflash_zoo.engine.drafter import DraftKV, Span
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.errors import ConfigError, DrafterFormatError
from dflash_zoo.formats import HF_NATIVE, SPECULATORS, check_expressible
from tests.oracles import greedy_reference
from tests.tiny import draft_config_dict, tiny_target

WINDOW, TAPS = 7, [0, 1, 3]
FIXTURES = Path(__file__).parent / "fixtures" / "configs"


def laguna_config(target=None, gating="per-head", layers=2, block_size=6, **extra) -> dict:
    """A config.json as poolside writes them: model_type laguna, capture depths beside the taps, a window."""
    raw = draft_config_dict(target, layers=layers, block_size=block_size, taps=TAPS)
    raw.update(
        architectures=["DFlashLagunaForCausalLM"],
        model_type="laguna",
        layer_types=["sliding_attention"] * layers,
        sliding_window=WINDOW,
        gating=gating,
        draft_vocab_size=raw["vocab_size"],
        eagle_aux_hidden_state_layer_ids=[t + 1 for t in TAPS],
    )
    raw["dflash_config"]["causal"] = True
    return {**raw, **extra}


def laguna_drafter(seed=4, **kw) -> LagunaDrafter:
    """Random weights, norms included (a fresh norm is all ones and would hide a norm applied to the wrong input)."""
    torch.manual_seed(seed)
    model = LagunaDrafter(normalize_draft_config(laguna_config(**kw))).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            if "g_proj" in name:
                p.mul_(4)  # gates well away from softplus(0)
    return model.eval()


# ---- the oracle ----------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """x [heads, T, hd] rotated (rotate-half) at integer positions pos [T]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None].double() * inv[None]  # [T, hd/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    half = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + half * sin


def oracle(tensors, raw, noise, feats):
    """One drafting pass, batch 1: context at positions 0..C-1, block at C..C+N-1. tensors: the checkpoint's."""
    t = {k: v.double() for k, v in tensors.items()}
    heads, kvh, hd, eps = (
        raw["num_attention_heads"],
        raw["num_key_value_heads"],
        raw["head_dim"],
        raw["rms_norm_eps"],
    )
    h = raw["hidden_size"]
    c, n = feats.shape[0], noise.shape[0]
    taps = [
        _rms(feats[:, i * h : (i + 1) * h].double(), t[f"aux_hidden_norms.{i}.weight"], eps) for i in range(3)
    ]
    ctx = _rms(torch.cat(taps, -1) @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    x = noise.double()
    qpos, kpos = torch.arange(c, c + n), torch.arange(c + n)
    # a query sees a key within the window, and block keys only up to itself (causal block)
    seen = (qpos[:, None] - kpos[None] < WINDOW) & (kpos[None] <= qpos[:, None])
    for i in range(raw["num_hidden_layers"]):
        p = f"layers.{i}."
        xin = _rms(x, t[p + "input_layernorm.weight"], eps)
        cin = _rms(ctx, t[p + "input_layernorm.weight"], eps)
        w = t[p + "self_attn.qkv_proj.weight"]
        wq, wk, wv = w[: heads * hd], w[heads * hd : (heads + kvh) * hd], w[(heads + kvh) * hd :]
        both = torch.cat(
            [cin, xin]
        )  # [C + N, H]: keys and values come from the normed context, then the block
        q = _rms((xin @ wq.T).view(n, heads, hd), t[p + "self_attn.q_norm.weight"], eps).transpose(0, 1)
        k = _rms((both @ wk.T).view(c + n, kvh, hd), t[p + "self_attn.k_norm.weight"], eps).transpose(0, 1)
        v = (both @ wv.T).view(c + n, kvh, hd).transpose(0, 1)
        theta = raw["rope_theta"]
        q, k = _rope(q, qpos, theta), _rope(k, kpos, theta)
        k, v = k.repeat_interleave(heads // kvh, 0), v.repeat_interleave(heads // kvh, 0)
        att = (q @ k.transpose(1, 2)) / math.sqrt(hd)
        out = torch.softmax(att.masked_fill(~seen, float("-inf")), -1) @ v  # [heads, N, hd]
        if raw["gating"] == "per-head":
            out = out * F.softplus(xin @ t[p + "self_attn.g_proj.weight"].T).T[:, :, None]
        out = out.transpose(0, 1).reshape(n, heads * hd)
        if raw["gating"] == "per-element":
            out = out * F.softplus(xin @ t[p + "self_attn.g_proj.weight"].T)
        x = x + out @ t[p + "self_attn.o_proj.weight"].T
        m = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
        x = (
            x
            + (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T))
            @ t[p + "mlp.down_proj.weight"].T
        )
    return _rms(x, t["norm.weight"], eps)


@pytest.mark.parametrize("gating", ["per-head", "per-element", False])
def test_forward_matches_the_oracle_at_once_and_through_the_cache(gating):
    model = laguna_drafter(gating=gating)
    raw, tensors = laguna_config(gating=gating), model.checkpoint_state()
    gen = torch.Generator().manual_seed(0)
    c, n = 11, 6
    feats = torch.randn(c, 3 * 64, generator=gen)
    noise = torch.randn(n, 64, generator=gen)
    want = oracle(tensors, raw, noise, feats)
    q_pos = torch.arange(c, c + n)
    with torch.no_grad():
        once = model(noise[None], feats[None], Span(q_pos, torch.arange(c)))[0]
        cache = DraftKV()
        model(noise[None, :2], feats[None, :7], Span(torch.arange(7, 9), torch.arange(7)), cache)
        cached = model(noise[None], feats[None, 7:], Span(q_pos, torch.arange(c)), cache)[0]
    torch.testing.assert_close(once.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cached, once, rtol=1e-5, atol=1e-5)
    assert (model.layers[0].self_attn.g_proj is None) == (gating is False)


def test_speculative_output_equals_plain_greedy_on_a_laguna_target(tmp_path):
    target = tiny_target("laguna", seed=1)
    save_drafter(laguna_drafter(target=target), tmp_path / "d")
    drafter = load_drafter(tmp_path / "d")
    assert isinstance(drafter, LagunaDrafter)
    adapter = get_adapter("laguna")(target)
    prompt = [5, 9, 3, 7, 11, 4, 8, 2 + 40, 17, 23]
    result = EagerEngine(adapter, drafter, drafter.cfg.mask_token_id).speculative(
        prompt, GenerationConfig(max_new_tokens=40, block_size=6)
    )
    assert result.output_ids == greedy_reference(target, prompt, 40)
    assert len(result.steps) < 40  # drafting ran: the steps commit the tokens, not one forward per token


def test_checkpoint_is_poolsides_layout_and_round_trips_bit_for_bit(tmp_path):
    model = laguna_drafter()
    save_drafter(model, tmp_path / "d")
    stored = load_file(tmp_path / "d" / "model.safetensors")
    assert "layers.0.self_attn.qkv_proj.weight" in stored and "layers.0.self_attn.q_proj.weight" not in stored
    assert {f"aux_hidden_norms.{i}.weight" for i in range(3)} <= set(stored)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashLagunaForCausalLM"] and raw["model_type"] == "laguna"
    assert raw["gating"] == "per-head" and raw["dflash_config"]["target_layer_ids"] == TAPS
    again = load_drafter(tmp_path / "d")
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    save_drafter(again, tmp_path / "e")
    assert load_file(tmp_path / "e" / "model.safetensors").keys() == stored.keys()
    assert all(torch.equal(load_file(tmp_path / "e" / "model.safetensors")[k], v) for k, v in stored.items())


# published checkpoints: tensors in model.safetensors, their shapes where a source names them, the file's bytes
# (S-2.1: a public port's notes quoting the header at the pinned commit; XS-2.1: the Hub's LFS size at its
# pinned commit and a public port's checkpoint contract, 58 tensors with the shapes below)
PUBLISHED = {
    "laguna-s-2.1": (69, 2_229_962_896, {}),
    "laguna-xs-2.1": (
        58,
        924_135_848,
        {
            "layers.0.self_attn.qkv_proj.weight": (10240, 2048),
            "layers.0.self_attn.g_proj.weight": (64, 2048),
            "aux_hidden_norms.4.weight": (2048,),
            "fc.weight": (2048, 10240),
        },
    ),
}


@pytest.mark.parametrize("slug", sorted(PUBLISHED))
def test_published_drafters_config_builds_their_checkpoints_tensors(slug):
    """The module built from a published config.json holds exactly as many tensors as the checkpoint, with the
    named shapes, and bf16 bytes that a safetensors header (a few KB) tops up to the file's size."""
    count, file_bytes, shapes = PUBLISHED[slug]
    raw = json.loads((FIXTURES / slug / "draft.json").read_text())
    with torch.device("meta"):
        state = LagunaDrafter(normalize_draft_config(raw)).checkpoint_state()
    assert len(state) == count
    assert {name: tuple(state[name].shape) for name in shapes} == shapes
    data = 2 * sum(t.numel() for t in state.values())
    assert data < file_bytes < data + 16_384, (data, file_bytes)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("layers.1.self_attn.g_proj.weight"), "missing layers.1.self_attn.g_proj.weight"),
        (lambda s: s.pop("aux_hidden_norms.2.weight"), "missing aux_hidden_norms.2.weight"),
        (lambda s: s.update({"layers.0.self_attn.qkv_proj.weight": torch.zeros(100, 64)}), "need 128 rows"),
        (lambda s: s.update({"layers.0.extra.weight": torch.zeros(2)}), "not used by laguna_dflash"),
        (lambda s: s.update({"layers.1.self_attn.k_proj.weight": torch.zeros(32, 64)}), "both hold"),
    ],
)
def test_incomplete_or_foreign_checkpoints_are_refused_by_name(tmp_path, edit, message):
    save_drafter(laguna_drafter(), tmp_path / "d")
    state = load_file(tmp_path / "d" / "model.safetensors")
    edit(state)
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(DrafterFormatError, match=message):
        load_drafter(tmp_path / "d")


def test_config_keys():
    assert normalize_draft_config(laguna_config(gating=True)).attention_gate == "per-head"
    assert normalize_draft_config(laguna_config(gating="disabled")).attention_gate is None
    with pytest.raises(DrafterFormatError, match="unknown gating 'per-token'"):
        normalize_draft_config(laguna_config(gating="per-token"))
    with pytest.raises(DrafterFormatError, match="only DFlashLagunaForCausalLM"):
        normalize_draft_config(draft_config_dict(gating="per-head"))
    with pytest.raises(ConfigError, match="do not match target_layer_ids"):
        normalize_draft_config(laguna_config(eagle_aux_hidden_state_layer_ids=TAPS))


def test_rope_nested_by_layer_type_is_read_for_the_drafters_layers():
    nested = {
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
    }
    cfg = normalize_draft_config(laguna_config(rope_parameters=nested))
    assert (cfg.rope.theta, cfg.rope.partial_rotary_factor) == (20000.0, 1.0)
    swa = {"rope_type": "default", "rope_theta": 500000.0}
    assert (
        normalize_draft_config(laguna_config(rope_parameters=nested, swa_rope_parameters=swa)).rope.theta
        == 5e5
    )
    mixed = laguna_config(rope_parameters=nested)
    mixed["layer_types"] = ["sliding_attention", "full_attention"]
    with pytest.raises(ConfigError, match="different rope parameters"):
        normalize_draft_config(mixed)


def test_layouts_without_its_parts_refuse_it():
    cfg = normalize_draft_config(laguna_config())
    with pytest.raises(DrafterFormatError, match="not laguna_dflash"):
        check_expressible(SPECULATORS, cfg, has_target=True)
    with pytest.raises(DrafterFormatError, match="laguna_dflash drafter"):
        check_expressible(HF_NATIVE, cfg, has_target=False)


def test_train_fine_tunes_a_laguna_drafter_and_keeps_its_layout(tmp_path):
    """`train --init` on a Laguna drafter: the DFlash loss over its own forward, the loss falls, and the result is
    a Laguna drafter saved with fused q/k/v that drafts better than where it started."""
    from dflash_zoo.training.train import train
    from tests.test_train import _acceptance, _cfg, _prompts, tiny_setup

    target, tok, examples = tiny_setup()
    save_drafter(laguna_drafter(target=target, block_size=8), tmp_path / "init")
    cfg = _cfg(tmp_path, steps=30)
    res = train(cfg, target, tok, examples, init=str(tmp_path / "init"))
    assert res.history[-1][1] < 0.7 * res.history[0][1]
    tuned = load_drafter(res.out_dir)
    assert isinstance(tuned, LagunaDrafter) and tuned.cfg.attention_gate == "per-head"
    assert "layers.0.self_attn.qkv_proj.weight" in load_file(f"{res.out_dir}/model.safetensors")
    held_out = _prompts(99, 4)
    before = _acceptance(target, tok, load_drafter(tmp_path / "init"), held_out)
    assert _acceptance(target, tok, tuned, held_out) > before + 0.5


def test_convert_keeps_a_laguna_drafter_in_its_layout_and_refuses_the_others(tmp_path):
    from tests.cli_runner import run_cli

    save_drafter(laguna_drafter(), tmp_path / "d")
    res = run_cli("convert", str(tmp_path / "d"), "--to", "zlab", str(tmp_path / "z"))
    assert res.code == 0, res.stderr
    before, after = (
        load_file(tmp_path / "d" / "model.safetensors"),
        load_file(tmp_path / "z" / "model.safetensors"),
    )
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    res = run_cli("convert", str(tmp_path / "d"), "--to", "hf-native", str(tmp_path / "h"))
    assert res.code == 2 and "laguna_dflash drafter" in res.stderr and not (tmp_path / "h").exists()
