"""transformers' native DFlash assistant layout (`MuseGlimmerAssistantModel`): config translation (torch-free).

Source: transformers `models/muse_glimmer_assistant/{configuration,modeling}_muse_glimmer_assistant.py` (5.17 to
5.25). The assistant is our DFlash drafter in other words, numerically identical where the mapping below holds
(tests/test_formats.py compares both forwards on random weights to 1e-5 in fp32):
- Qwen3-style layers (RMSNorm, GQA with q_norm / k_norm on each head, RoPE, SwiGLU), no embedding and no head;
  the fusion `encoder.fc` + `encoder.output_norm_enc` is our `fc` + `hidden_norm`; the context enters every
  layer's K/V without the layer's input norm, as in ours;
- every layer is bidirectional inside the block; a sliding layer attends where |q - k| <= sliding_window
  (transformers' `sliding_window_bidirectional_overlay`), ours where the distance is < window: W reads as W + 1;
- flat config keys with the class defaults (rope theta 500000, eps 1e-5, five sliding layers, ...) for what a
  config leaves out; no `vocab_size` (the head is the target's): one given is kept, else the Muse Glimmer text
  model's 202048, the vocabulary the class was written for.
Refused, with the reason, because the assistant would compute something else: DFlash 2, attention biases,
causal layers, a logit multiplier or soft-cap, a scaled block embedding, a reduced draft vocabulary, partial
rotary, activations other than silu / gelu / gelu_pytorch_tanh.
"""

from __future__ import annotations

from typing import Any

from dflash_zoo.errors import DrafterFormatError

MODEL_TYPE = "muse_glimmer_assistant"
ARCHITECTURE = "MuseGlimmerAssistantModel"
# MuseGlimmerAssistantConfig's defaults (what transformers fills in for a key a config leaves out)
DEFAULTS: dict[str, Any] = {
    "hidden_size": 6656,
    "intermediate_size": 19968,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "sliding_window": 2048,
    "hidden_act": "silu",
    "block_size": 16,
    "mask_token_id": 201818,
    "target_layer_ids": [1, 13, 25, 37, 49],
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}
DEFAULT_VOCAB = 202048  # transformers MuseGlimmerTextConfig.vocab_size
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
_SHAPE = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def to_zlab(raw: dict[str, Any]) -> dict[str, Any]:
    """The z-lab config dict of a `MuseGlimmerAssistantModel` config."""
    c = {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    types = list(c.get("layer_types") or ["sliding_attention"] * c["num_hidden_layers"])
    rope = dict(c["rope_parameters"])
    if rope.get("partial_rotary_factor", 1.0) != 1.0 or c.get("partial_rotary_factor", 1.0) != 1.0:
        raise DrafterFormatError(
            "muse_glimmer_assistant config with partial_rotary_factor: transformers' assistant rotates every "
            "dimension for the default rope type, so dflash-zoo would compute something else"
        )
    if c["hidden_act"] not in ACTIVATIONS:
        raise DrafterFormatError(
            f"muse_glimmer_assistant hidden_act {c['hidden_act']!r} is not one dflash-zoo runs"
        )
    rope.setdefault("rope_theta", DEFAULTS["rope_parameters"]["rope_theta"])
    out = {k: c[k] for k in (*_SHAPE, "head_dim", "rms_norm_eps", "max_position_embeddings", "hidden_act")}
    out.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        vocab_size=raw.get("vocab_size", DEFAULT_VOCAB),
        attention_bias=False,
        rope_parameters=rope,
        layer_types=types,
        dflash_config={
            "block_size": c["block_size"],
            "mask_token_id": c["mask_token_id"],
            "target_layer_ids": list(c["target_layer_ids"]),
            "causal": False,  # every layer of the assistant is bidirectional inside the block
        },
    )
    if "sliding_attention" in types:  # |q - k| <= W is a distance < W + 1
        out["sliding_window"] = _int(c["sliding_window"], "sliding_window") + 1
    if raw.get("num_target_layers") is not None:
        out["num_target_layers"] = raw["num_target_layers"]
    if raw.get("quantization_config") is not None:  # kept for the quantized-drafter check
        out["quantization_config"] = raw["quantization_config"]
    return out


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DrafterFormatError(f"muse_glimmer_assistant {key} must be a positive integer, got {value!r}")
    return value


def from_draft(cfg: Any) -> dict[str, Any]:
    """The `MuseGlimmerAssistantModel` config.json of a `DraftConfig`, or `DrafterFormatError` with the reason."""
    from dflash_zoo.formats.rope import rope_parameters

    refuse_inexpressible(cfg)
    sliding = "sliding_attention" in cfg.layer_types
    window = (
        cfg.sliding_window - 1 if sliding else DEFAULTS["sliding_window"]
    )  # unused without sliding layers
    out = {
        k: getattr(cfg, k)
        for k in (*_SHAPE, "head_dim", "rms_norm_eps", "max_position_embeddings", "hidden_act")
    }
    out.update(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        rope_parameters=rope_parameters(cfg),
        layer_types=list(cfg.layer_types),
        sliding_window=window,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=list(cfg.target_layer_ids),
        vocab_size=cfg.vocab_size,  # not a field of the class: kept as an attribute, and read back here
        attention_dropout=0.0,
    )
    if cfg.num_target_layers is not None:
        out["num_target_layers"] = cfg.num_target_layers
    return out


def refuse_inexpressible(cfg: Any) -> None:
    """`DrafterFormatError` naming the first thing transformers' assistant would compute differently."""
    why = _difference(cfg)
    if why:
        raise DrafterFormatError(
            f"transformers' MuseGlimmerAssistantModel cannot express this drafter: {why}",
            hint="keep it in the z-lab layout (`--to zlab`), or speculators' where that applies",
        )


def _difference(cfg: Any) -> str | None:
    if cfg.arch != "dflash":
        return f"it is a {cfg.arch} drafter (the assistant has no convolutions or candidate selector)"
    if cfg.draft_vocab_size:
        return f"it has a reduced draft vocabulary ({cfg.draft_vocab_size}); the assistant uses the target's head"
    if cfg.attention_bias:
        return "its attention projections have biases"
    if any(cfg.causal):
        return f"some layers are causal inside the block ({list(cfg.causal)}); the assistant's never are"
    if (
        cfg.output_multiplier != 1.0
        or cfg.final_logit_softcapping is not None
        or cfg.input_embedding_scale is not None
    ):
        return "it transforms its logits or scales its block embedding; the assistant uses the target's as they are"
    if cfg.mask_token_id is None:
        return "it names no mask token id, which the assistant's config requires"
    if cfg.rope.partial_rotary_factor != 1.0:
        return "it rotates only part of each head"
    if "sliding_attention" in cfg.layer_types and cfg.sliding_window < 2:
        return f"its sliding window {cfg.sliding_window} is shorter than the assistant's smallest (distance <= 1)"
    return None
