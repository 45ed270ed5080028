"""Drafter checkpoint layouts: z-lab's, vllm-project/speculators', and transformers' native assistant format.

One DFlash drafter can be stored three ways; `dflash-zoo` reads each into the same `DraftConfig` and drafter:
- `zlab` (z-lab/dflash): a Qwen3 `config.json` with `dflash_config`; weights under the drafter's own names
  (`engine/config.py` reads every generation of it);
- `speculators` (vllm-project/speculators, `speculators_model_type` "dflash" / "dflash2"): the layer shape in
  `transformer_layer_config`, taps as `aux_hidden_state_layer_ids` (= z-lab ids + 1), copies of the verifier's
  embedding, LM head and final norm among the weights, optionally a reduced draft vocabulary (`t2d` / `d2t`);
- `hf-native` (transformers `MuseGlimmerAssistantModel`, `model_type` "muse_glimmer_assistant"): flat config
  keys, the fusion under `encoder.fc` / `encoder.output_norm_enc`, every layer bidirectional.

Contract:
- `detect(raw)` names a config's layout from its shape alone, in this one place; `as_zlab(raw)` turns any of
  them into the z-lab config dict it is equivalent to, refusing what our drafter cannot run exactly, with the
  reason. `engine/config.normalize_draft_config` calls it, so `check`, `info`, loading and `convert` read every
  layout the same way. Torch-free: the layouts' config modules import neither torch nor transformers.
- Tensor names per layout, verifier copies, reduced vocabularies, quantized drafters and the writers live in
  `weights.py`, `verifier.py`, `draft_vocab.py`, `quantized.py` and `write.py` (torch).
"""

from __future__ import annotations

from typing import Any

from dflash_zoo.formats import hf_native, speculators

ZLAB, SPECULATORS, HF_NATIVE = "zlab", "speculators", "hf-native"
LAYOUTS = (ZLAB, SPECULATORS, HF_NATIVE)
# what each layout is called in messages and help
DESCRIPTIONS = {
    ZLAB: "z-lab/dflash (DFlashDraftModel / DFlash2DraftModel config.json)",
    SPECULATORS: "vllm-project/speculators (speculators_model_type dflash / dflash2)",
    HF_NATIVE: "transformers' native assistant (MuseGlimmerAssistantModel)",
}


def detect(raw: dict[str, Any]) -> str:
    """The layout of a drafter `config.json` dict, from the keys only its layout has."""
    if "speculators_model_type" in raw or "transformer_layer_config" in raw:
        return SPECULATORS
    if raw.get("model_type") == hf_native.MODEL_TYPE or hf_native.ARCHITECTURE in (
        raw.get("architectures") or []
    ):
        return HF_NATIVE
    return ZLAB


def as_zlab(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the z-lab config dict equivalent to `raw`, the layout `raw` is in); a z-lab config comes back as is."""
    layout = detect(raw)
    if layout == SPECULATORS:
        return speculators.to_zlab(raw), layout
    if layout == HF_NATIVE:
        return hf_native.to_zlab(raw), layout
    return raw, layout


def read_drafter_config(raw: dict[str, Any], num_target_layers: int | None = None) -> tuple[Any, str]:
    """(`DraftConfig`, layout) of a raw drafter config in any layout."""
    from dflash_zoo.engine.config import normalize_draft_config

    cfg = normalize_draft_config(raw, num_target_layers)
    return cfg, cfg.layout


def check_expressible(layout: str, cfg: Any, has_target: bool) -> None:
    """Refuse, with the reason, writing `cfg` in `layout` where the layout cannot express it (torch-free).

    Args:
        layout: one of `LAYOUTS`.
        cfg: the drafter's `DraftConfig`.
        has_target: a target is at hand (a speculators checkpoint names its verifier and carries its tensors).
    """
    from dflash_zoo.errors import DrafterFormatError

    if layout == HF_NATIVE:
        hf_native.refuse_inexpressible(cfg)
    elif layout == SPECULATORS:
        speculators.refuse_inexpressible(cfg)
        if not has_target:
            raise DrafterFormatError(
                "a speculators checkpoint names its verifier and carries the verifier's embedding, LM head and "
                "final norm: they must come from a target",
                hint="pass --target with the target this drafter was trained for (a local dir or Hub id)",
            )
    elif cfg.draft_vocab_size:
        raise DrafterFormatError(
            f"z-lab drafters use the target's whole vocabulary; this one drafts from {cfg.draft_vocab_size} "
            "tokens through its own head",
            hint="keep it in the speculators layout (`--to speculators`)",
        )
    elif cfg.num_target_layers is None and not has_target:  # z-lab's loader computes with it unconditionally
        raise DrafterFormatError(
            "a z-lab config holds the target's layer count (num_target_layers), which this drafter's "
            f"{cfg.layout} config does not",
            hint="pass --target with the drafter's target (a local dir or Hub id): its config gives the count",
        )
