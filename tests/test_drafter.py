"""Drafter numerics against an independent reference, RoPE against transformers, and the loader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_zoo.engine.checkpoint import load_drafter, save_drafter
from dflash_zoo.engine.config import RopeSpec, normalize_draft_config
from dflash_zoo.engine.drafter import DFlashDrafter, DraftKV, Span
from dflash_zoo.engine.rope import inverse_frequencies
from dflash_zoo.errors import CheckpointError, NotFoundError
from tests.tiny import draft_config_dict

qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")


def reference_forward(model: DFlashDrafter, noise, target_hidden, positions):
    """z-lab's drafter forward rebuilt from transformers' own Qwen3 modules and explicit attention maths.

    K/V over [context ; block], Q from the block, RoPE on Q with the last q_len positions, no mask.
    """
    import transformers

    cfg = model.cfg
    hf_cfg = transformers.Qwen3Config(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope.theta,
        rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=cfg.vocab_size,
    )
    rotary = qwen3.Qwen3RotaryEmbedding(hf_cfg)
    sd = model.state_dict()

    def norm(x, name):
        m = qwen3.Qwen3RMSNorm(x.shape[-1], cfg.rms_norm_eps)
        m.weight.data = sd[name]
        return m(x)

    def lin(x, name):
        return x @ sd[name].T

    ctx = norm(lin(target_hidden, "fc.weight"), "hidden_norm.weight")
    cos, sin = rotary(noise, positions[None])
    h, (b, q_len, c_len) = noise, (1, noise.shape[1], ctx.shape[1])
    nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        x = norm(h, p + "input_layernorm.weight")
        q = norm(
            lin(x, p + "self_attn.q_proj.weight").view(b, q_len, nh, hd), p + "self_attn.q_norm.weight"
        ).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)
        k = norm(
            lin(kv_in, p + "self_attn.k_proj.weight").view(b, c_len + q_len, kvh, hd),
            p + "self_attn.k_norm.weight",
        )
        k = k.transpose(1, 2)
        v = lin(kv_in, p + "self_attn.v_proj.weight").view(b, c_len + q_len, kvh, hd).transpose(1, 2)
        q, _ = qwen3.apply_rotary_pos_emb(q, q, cos[:, -q_len:], sin[:, -q_len:])
        k, _ = qwen3.apply_rotary_pos_emb(k, k, cos, sin)
        k, v = qwen3.repeat_kv(k, nh // kvh), qwen3.repeat_kv(v, nh // kvh)
        attn = ((q @ k.transpose(-1, -2)) * hd**-0.5).softmax(-1) @ v
        h = h + lin(attn.transpose(1, 2).reshape(b, q_len, nh * hd), p + "self_attn.o_proj.weight")
        x = norm(h, p + "post_attention_layernorm.weight")
        gate, up = lin(x, p + "mlp.gate_proj.weight"), lin(x, p + "mlp.up_proj.weight")
        h = h + lin(torch.nn.functional.silu(gate) * up, p + "mlp.down_proj.weight")
    return norm(h, "norm.weight")


@pytest.fixture
def drafter():
    torch.manual_seed(0)
    model = DFlashDrafter(normalize_draft_config(draft_config_dict(layers=2, block_size=8, taps=[0, 2])))
    with torch.no_grad():  # non-trivial norms so a wrong norm placement shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def test_matches_reference_in_one_pass(drafter):
    ctx_len, block = 11, 8
    noise, feats = torch.randn(1, block, 64), torch.randn(1, ctx_len, 128)
    positions = torch.arange(ctx_len + block)
    with torch.no_grad():
        ours = drafter(noise, feats, Span(q_pos=positions[ctx_len:], ctx_pos=positions[:ctx_len]))
        ref = reference_forward(drafter, noise, feats, positions)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_incremental_context_cache_equals_one_pass(drafter):
    noise, feats = torch.randn(1, 8, 64), torch.randn(1, 15, 128)
    with torch.no_grad():
        full = drafter(noise, feats, Span(q_pos=torch.arange(15, 23), ctx_pos=torch.arange(15)))
        kv = DraftKV()
        drafter(
            torch.randn(1, 8, 64), feats[:, :9], Span(q_pos=torch.arange(9, 17), ctx_pos=torch.arange(9)), kv
        )
        inc = drafter(noise, feats[:, 9:], Span(q_pos=torch.arange(15, 23), ctx_pos=torch.arange(15)), kv)
    assert kv.length == 15 and kv.layers[0][0].shape[2] == 15  # only context K/V are cached
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)


def test_span_mask_training_layout():
    """Two blocks with anchors 3 and 6: context strictly before the anchor, own block only."""
    span = Span(
        q_pos=torch.tensor([3, 4, 6, 7]),
        ctx_pos=torch.arange(8),
        q_limit=torch.tensor([3, 3, 6, 6]),
        q_segment=torch.tensor([0, 0, 1, 1]),
    )
    mask = span.mask(causal=False, window=None)
    assert mask[0, :8].tolist() == [True] * 3 + [False] * 5
    assert mask[2, :8].tolist() == [True] * 6 + [False] * 2
    assert mask[:, 8:].tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2
    causal = span.mask(causal=True, window=2)
    assert causal[1, 8:].tolist() == [True, True, False, False] and causal[1, :8].tolist() == [False] * 8
    assert causal[2, :8].tolist() == [False] * 5 + [True, False, False]


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 1e6},
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 1.5e5,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
        },
        {
            "rope_type": "yarn",
            "rope_theta": 5e4,
            "factor": 64.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
    ],
)
def test_rope_matches_transformers(rope_parameters):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(
        head_dim=128,
        num_attention_heads=4,
        hidden_size=512,
        max_position_embeddings=131072,
        rope_parameters=dict(rope_parameters),
    )
    spec = normalize_draft_config({**draft_config_dict(), "rope_parameters": dict(rope_parameters)}).rope
    assert isinstance(spec, RopeSpec)
    ours, our_scale = inverse_frequencies(spec, 128, 131072)
    if rope_parameters["rope_type"] == "default":
        ref = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](hf, "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(ref_scale)


def test_save_load_round_trip_is_zlab_format(tmp_path, drafter):
    out = save_drafter(drafter, tmp_path / "d")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "auto_map" not in cfg
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["dflash_config"]["block_size"] == 8
    loaded = load_drafter(out)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no temp leftovers


def test_sharded_checkpoint_loads(tmp_path, drafter):
    save_drafter(drafter, tmp_path / "d")
    state = {k: v.contiguous() for k, v in drafter.state_dict().items()}
    keys = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
        "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
    }
    (tmp_path / "d" / "model.safetensors").unlink()
    for fname, names in shards.items():
        save_file({k: state[k] for k in names}, str(tmp_path / "d" / fname))
    index = {"weight_map": {k: f for f, names in shards.items() for k in names}}
    (tmp_path / "d" / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_drafter(tmp_path / "d")
    assert torch.equal(loaded.fc.weight, drafter.fc.weight)


def test_missing_and_misshaped_tensors_are_named(tmp_path, drafter):
    save_drafter(drafter, tmp_path / "d")
    state = {k: v.contiguous() for k, v in drafter.state_dict().items()}
    save_file(
        {k: v for k, v in state.items() if k != "layers.1.mlp.up_proj.weight"},
        str(tmp_path / "d" / "model.safetensors"),
    )
    with pytest.raises(CheckpointError, match=r"\(dflash\): missing layers.1.mlp.up_proj.weight$"):
        load_drafter(tmp_path / "d")
    save_file({**state, "fc.weight": torch.zeros(3, 3)}, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'fc.weight' has shape"):
        load_drafter(tmp_path / "d")


def test_corrupted_file_and_pickle_only_checkpoints_are_refused(tmp_path, drafter):
    save_drafter(drafter, tmp_path / "d")
    path = tmp_path / "d" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot read model.safetensors"):
        load_drafter(tmp_path / "d")
    path.unlink()
    (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"not loaded: we never unpickle")
    with pytest.raises(CheckpointError, match="no .safetensors weights"):
        load_drafter(tmp_path / "d")


def test_unknown_path_is_a_clear_error(tmp_path):
    with pytest.raises(NotFoundError, match="no such directory"):
        load_drafter(tmp_path / "does-not-exist")
