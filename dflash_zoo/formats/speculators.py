"""The vllm-project/speculators layout of DFlash drafters: config translation both ways (torch-free).

Source: speculators `src/speculators/models/dflash/{config.py,core.py,model_definitions.py}`,
`models/dflash2/config.py` and the z-lab converter `convert/dflash/converter.py`:
- `speculators_model_type` "dflash" / "dflash2"; the decoder layer's shape in `transformer_layer_config` (a Qwen3
  config, serialised as its difference from Qwen3Config's defaults, which fill in what it omits);
- `aux_hidden_state_layer_ids` are z-lab `target_layer_ids` + 1 (the converter's rule: speculators counts the
  embedding output as hidden state 0); `block_size`, `mask_token_id` at the top, DFlash 2's four shape keys too;
- full-attention layers are bidirectional inside the block, sliding ones causal unless
  `sliding_window_non_causal` (default false for dflash, true for dflash2);
- the drafter embeds its block with a copy of the verifier's embedding table and projects through `lm_head`
  (the verifier's head, or its rows `t2d` selects for a reduced `draft_vocab_size`; `d2t` maps a draft id d
  back to the target id d + d2t[d]); `verifier_lm_head` / `verifier_norm` are frozen copies used in training.
What the layout has no field for is refused on writing, never dropped: a drafter logit multiplier or soft-cap,
a scaled block embedding, causal full-attention layers, per-layer causality among sliding layers.
"""

from __future__ import annotations

from typing import Any

from dflash_zoo.errors import DrafterFormatError

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# the `architectures` speculators' own configs write (DFlashSpeculatorConfig, DFlash2SpeculatorConfig defaults)
WRITTEN_ARCHITECTURES = {"dflash": "DFlashSpeculator", "dflash2": "DFlash2DraftModel"}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# transformers Qwen3Config defaults (5.17 to 5.25): a diff-serialised transformer_layer_config omits these values
QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
}
# keys of a speculators config that are the layer's, not the drafter's, or training-only
_NOT_LAYER = ("architectures", "auto_map", "dflash_config", "block_size", "transformers_version", "dtype")


def to_zlab(raw: dict[str, Any]) -> dict[str, Any]:
    """The z-lab config dict of a speculators DFlash / DFlash 2 config; what our drafter cannot run is refused."""
    kind = _kind(raw)
    _refuse_other_drafters(raw)
    layer = _layer_config(raw)
    hidden = layer["hidden_size"]
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and target_hidden != hidden:
        raise DrafterFormatError(
            f"speculators drafter: target_hidden_size {target_hidden} != hidden_size {hidden}; dflash-zoo's "
            "drafters have the target's width"
        )
    out = {k: v for k, v in layer.items() if k not in _NOT_LAYER}
    dcfg: dict[str, Any] = {
        "block_size": raw.get("block_size"),
        "target_layer_ids": taps_from_aux(raw.get("aux_hidden_state_layer_ids")),
        "mask_token_id": raw.get("mask_token_id"),
    }
    non_causal = raw.get("sliding_window_non_causal", kind == "dflash2")
    if not isinstance(non_causal, bool):
        raise DrafterFormatError(
            f"speculators drafter: sliding_window_non_causal must be true or false, got {non_causal!r}"
        )
    if non_causal:  # full layers are bidirectional anyway: every layer is
        dcfg["causal"] = False
    draft_vocab = raw.get("draft_vocab_size", layer["vocab_size"])
    if draft_vocab != layer["vocab_size"]:
        dcfg["draft_vocab_size"] = draft_vocab  # a reduced head: drafters/draft_vocab.py
    if kind == "dflash2":
        dcfg.update({k: raw[k] for k in DFLASH2_KEYS if k in raw})
    if raw.get("quantization_config") is not None:  # kept for the quantized-drafter check
        out["quantization_config"] = raw["quantization_config"]
    out.update(architectures=[ARCHITECTURES[kind]], model_type="qwen3", dflash_config=dcfg)
    return out


def verifier_name(raw: dict[str, Any]) -> str | None:
    """The `name_or_path` of the verifier a speculators config names (None in other layouts, or unnamed)."""
    spec = raw.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    named = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return named if isinstance(named, str) and named else None


def _kind(raw: dict[str, Any]) -> str:
    kind = raw.get("speculators_model_type")
    if kind not in ARCHITECTURES:
        raise DrafterFormatError(
            f"speculators model type {kind!r} is not a DFlash drafter; dflash-zoo reads "
            + " and ".join(ARCHITECTURES),
            hint="EAGLE, MTP and DSpark speculators run in vLLM / SGLang, not here",
        )
    return kind


def _refuse_other_drafters(raw: dict[str, Any]) -> None:
    """Settings that make a speculators DFlash config another drafter than ours (named with the reason)."""
    if raw.get("projector_type", "dflash") != "dflash":
        raise DrafterFormatError(
            f"speculators projector_type {raw['projector_type']!r}: a correction head dflash-zoo does not run"
        )
    if raw.get("sample_from_anchor"):
        raise DrafterFormatError(
            "speculators drafter trained with sample_from_anchor=true: it proposes the anchor slot too, and "
            "dflash-zoo's loop uses slot 0 as the committed bonus token"
        )
    if raw.get("shift_label"):
        raise DrafterFormatError("speculators drafter trained with shift_label=true: its slots are shifted")


def _layer_config(raw: dict[str, Any]) -> dict[str, Any]:
    """`transformer_layer_config` with Qwen3Config's defaults for what a diff-serialised one leaves out."""
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DrafterFormatError("speculators drafter config has no transformer_layer_config object")
    model_type = layer.get("model_type", "qwen3")
    if model_type != "qwen3":  # another class's defaults would apply: every shape key must then be given
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
            if k not in layer
        ]
        if missing:
            raise DrafterFormatError(
                f"speculators transformer_layer_config ({model_type}) does not give {', '.join(missing)}",
                hint="only a qwen3 layer config may leave keys at their defaults",
            )
        return dict(layer)
    out = {**QWEN3_DEFAULTS, **layer}
    if "rope_parameters" not in layer and ("rope_theta" in layer or "rope_scaling" in layer):
        del out["rope_parameters"]  # the older spelling of the same parameters is given: it alone applies
    return out


def taps_from_aux(aux: Any) -> list[int]:
    """z-lab tap ids from speculators `aux_hidden_state_layer_ids` (each minus one), checked."""
    if not isinstance(aux, list) or not aux:
        raise DrafterFormatError(
            f"speculators aux_hidden_state_layer_ids must be a non-empty list, got {aux!r}"
        )
    bad = [i for i in aux if isinstance(i, bool) or not isinstance(i, int) or i < 1]
    if bad:
        raise DrafterFormatError(
            f"speculators aux_hidden_state_layer_ids {bad}: each must be >= 1 (id k is the output of decoder "
            "layer k - 1; 0 would be the embedding output, which DFlash drafters do not tap)"
        )
    return [i - 1 for i in aux]


def from_draft(cfg: Any, verifier: dict[str, Any]) -> dict[str, Any]:
    """The speculators config.json of a `DraftConfig`; `verifier` is {"name_or_path", "architectures"}.

    Raises `DrafterFormatError` naming what the layout cannot express.
    """
    refuse_inexpressible(cfg)
    kind = cfg.arch
    sliding = [c for c, t in zip(cfg.causal, cfg.layer_types, strict=True) if t == "sliding_attention"]
    out: dict[str, Any] = {
        "speculators_model_type": kind,
        "architectures": [WRITTEN_ARCHITECTURES[kind]],
        "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": bool(sliding) and not sliding[0],
        "projector_type": "dflash",
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
    }
    if cfg.dflash2 is not None:
        out.update({k: getattr(cfg.dflash2, k) for k in DFLASH2_KEYS})
    return out


def refuse_inexpressible(cfg: Any) -> None:
    """`DrafterFormatError` for what a speculators config has no field for."""
    if cfg.arch not in ARCHITECTURES:
        raise DrafterFormatError(
            f"speculators configs describe {' and '.join(ARCHITECTURES)} drafters, not {cfg.arch}",
            hint="keep it in the z-lab layout (`--to zlab`)",
        )
    if cfg.output_multiplier != 1.0 or cfg.final_logit_softcapping is not None:
        raise DrafterFormatError(
            "speculators configs have no drafter logit multiplier or soft-cap (this drafter has "
            f"output_multiplier {cfg.output_multiplier}, soft-cap {cfg.final_logit_softcapping})",
            hint="keep it in the z-lab layout (`--to zlab`)",
        )
    if cfg.input_embedding_scale is not None:
        raise DrafterFormatError(
            f"speculators configs have no block-embedding scale (this drafter has {cfg.input_embedding_scale})",
            hint="keep it in the z-lab layout (`--to zlab`)",
        )
    full = [c for c, t in zip(cfg.causal, cfg.layer_types, strict=True) if t == "full_attention"]
    sliding = [c for c, t in zip(cfg.causal, cfg.layer_types, strict=True) if t == "sliding_attention"]
    if any(full) or len(set(sliding)) > 1:
        raise DrafterFormatError(
            "speculators configs make full-attention layers bidirectional and all sliding layers alike "
            f"(sliding_window_non_causal); this drafter's in-block causality per layer is {list(cfg.causal)}",
            hint="keep it in the z-lab layout (`--to zlab`)",
        )


def layer_config(cfg: Any) -> dict[str, Any]:
    """`transformer_layer_config`: the whole Qwen3 layer config (not a diff, so no reader depends on defaults)."""
    from dflash_zoo.formats.rope import rope_parameters

    sliding = "sliding_attention" in cfg.layer_types
    return {
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": cfg.attention_bias,
        "rope_parameters": rope_parameters(cfg),
        "layer_types": list(cfg.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window,
        "tie_word_embeddings": False,
    }
