"""Draft-config normalisation: every z-lab `config.json` generation becomes one frozen `DraftConfig`.

Torch-free on purpose: `check`, `info` and `list` read configs without importing torch.

Generations handled (docs/method.md §5):
- early (Jan 2026): `block_size` / `num_target_layers` top-level, taps from the default rule,
  `rope_theta` + `rope_scaling`, all layers full attention;
- taps and mask in `dflash_config.{target_layer_ids, mask_token_id}`;
- transformers-5 exports: `block_size` nested in `dflash_config`, `rope_parameters` (yarn / llama3 inside),
  `layer_types` + `sliding_window`;
- newer upstream: per-layer causality (sliding layers causal, full layers non-causal) unless
  `dflash_config.causal` / `is_causal` says otherwise (rule shared with vLLM `qwen3_dflash.py`).

Tap convention, documented once here: `target_layer_ids` are 0-based decoder-layer indices and the feature
for id k is the *output* of decoder layer k, i.e. Hugging Face `hidden_states[k + 1]`. Engines that store
"k + 1" (SGLang, vLLM `eagle_aux_hidden_state_layer_ids`, speculators, GGUF) must be converted by -1.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_zoo import drafters
from dflash_zoo.drafters import DFlash2Params
from dflash_zoo.errors import ConfigError, ZooError

FULL, SLIDING = "full_attention", "sliding_attention"
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """Upstream default taps (z-lab `build_target_layer_ids`): evenly spaced from 1 to L-3.

    Python's `round` (banker's rounding) is part of the rule: L=36, n=5 gives [1, 9, 17, 25, 33].
    """
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4  # taps run from 1 to L-3
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters, whatever spelling the checkpoint used."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek/Kimi spelling)
    mscale_all_dim: float | None = None  # yarn (DeepSeek/Kimi spelling)
    attention_factor: float | None = None  # yarn explicit override
    truncate: bool = True  # yarn: round the correction range to integers
    partial_rotary_factor: float = 1.0


@dataclass(frozen=True)
class DraftConfig:
    """Everything the drafter and the engine need from a draft `config.json`."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    mask_token_id: int | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: tuple[bool, ...]
    rope: RopeSpec
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    final_logit_softcapping: float | None = (
        None  # the drafter's own logit transforms (z-lab `compute_logits`)
    )
    output_multiplier: float = 1.0
    input_embedding_scale: float | None = None  # set: the block is embedded as raw table rows times this
    arch: str = "dflash"  # the architecture (dflash_zoo/drafters), from `architectures`
    dflash2: DFlash2Params | None = None  # DFlash 2's convolution and selector shapes
    attention_gate: str | None = None  # Laguna drafters: "per-head" / "per-element" softplus output gate
    taps_from_default_rule: bool = False
    draft_vocab_size: int | None = None  # a reduced draft vocabulary, with its own head (formats/)
    layout: str = field(default="zlab", compare=False)  # the checkpoint layout it was read from (formats/)
    verifier: str | None = field(default=None, compare=False)  # the target a speculators drafter names
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def variant(self) -> str:
        """The architecture as `check` and `info` name it ("dflash", "dflash (in-block causal)", "dflash2")."""
        return drafters.variant(drafters.ARCHS[self.arch], self.causal, self.layer_types)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (used by `info --json`, `check --json`)."""
        out = asdict(self)
        out.pop("raw")
        return out


def load_draft_config(path: str | Path) -> DraftConfig:
    """Read and normalise `config.json` (a file or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read {path}: {exc.strerror or exc}",
            hint="check the file's permissions, or copy it again",
        ) from exc
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid UTF-8 (byte {exc.start}: {exc.object[exc.start]:#04x})",
            hint="a drafter config.json is UTF-8 JSON; re-save it as UTF-8 or fetch it again",
        ) from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}", hint="fix the file or fetch it again") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object", hint="fix the file or fetch it again")
    return normalize_config_file(raw, path)


def normalize_config_file(
    raw: dict[str, Any], path: Path, num_target_layers: int | None = None
) -> DraftConfig:
    """`normalize_draft_config` of the config read from `path`, every failure naming that file (a cached
    config's snapshot says which revision it is)."""
    try:
        return normalize_draft_config(raw, num_target_layers)
    except ZooError as exc:
        raise type(exc)(f"{path}: {exc}", hint=exc.hint or "fix the file or fetch it again") from exc
    except (TypeError, ValueError, AttributeError) as exc:  # a field of a type no check foresaw
        raise ConfigError(
            f"{path}: a field has an unexpected type or value ({exc})", hint="fix the file or fetch it again"
        ) from exc


def normalize_draft_config(raw: dict[str, Any], num_target_layers: int | None = None) -> DraftConfig:
    """Normalise one raw draft config dict; `num_target_layers` fills in when the config lacks it.

    Every field is checked for its type and range here, so a bad config fails with one line naming the key
    before any weights load. A drafter in another layout (dflash_zoo/formats) reads as its z-lab equivalent.
    """
    from dflash_zoo import formats

    verifier = formats.speculators.verifier_name(raw)
    raw, layout = formats.as_zlab(raw)
    dcfg = raw.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise ConfigError(f"dflash_config must be a JSON object, got {type(dcfg).__name__}")
    get = _getter(raw, dcfg)
    spec = drafters.arch_of(raw, get)
    hidden, heads = (
        _int(raw.get("hidden_size"), "hidden_size"),
        _int(raw.get("num_attention_heads"), "num_attention_heads"),
    )
    layers = _int(raw.get("num_hidden_layers"), "num_hidden_layers")
    block = _int(get("block_size", 16), "block_size", minimum=0)
    if block < 2:
        raise ConfigError(f"block_size must be >= 2, got {block}")
    n_target = get("num_target_layers", num_target_layers)
    n_target = None if n_target is None else _int(n_target, "num_target_layers")
    taps, from_rule = _taps(get("target_layer_ids"), n_target, layers)
    _check_capture_ids(get("eagle_aux_hidden_state_layer_ids"), taps)
    layer_types = _layer_types(raw, layers)
    mask = get("mask_token_id")
    softcap = get("final_logit_softcapping")
    embed_scale = get("input_embedding_scale")
    return DraftConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_int(raw.get("num_key_value_heads") or heads, "num_key_value_heads"),
        head_dim=_int(raw.get("head_dim") or hidden // heads, "head_dim"),
        intermediate_size=_int(raw.get("intermediate_size"), "intermediate_size"),
        vocab_size=_int(raw.get("vocab_size"), "vocab_size"),
        block_size=block,
        target_layer_ids=taps,
        num_target_layers=n_target,
        mask_token_id=None
        if mask is None
        else _int(mask, "mask_token_id", minimum=-(2**63)),  # range: `check`
        layer_types=layer_types,
        sliding_window=_sliding_window(raw, layer_types),
        causal=_causality(raw, dcfg, layer_types),
        rope=_rope(raw, layer_types),
        rms_norm_eps=_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        attention_bias=bool(raw.get("attention_bias", False)),
        hidden_act=_hidden_act(raw.get("hidden_act", "silu")),
        max_position_embeddings=_int(raw.get("max_position_embeddings", 40960), "max_position_embeddings"),
        final_logit_softcapping=None if softcap is None else _float(softcap, "final_logit_softcapping"),
        output_multiplier=_float(get("output_multiplier", 1.0), "output_multiplier"),
        input_embedding_scale=None if embed_scale is None else _float(embed_scale, "input_embedding_scale"),
        arch=spec.name,
        dflash2=_dflash2(spec, get, hidden, _int(raw.get("vocab_size"), "vocab_size")),
        attention_gate=drafters.attention_gate(spec, get("gating")),
        taps_from_default_rule=from_rule,
        draft_vocab_size=_draft_vocab(spec, get("draft_vocab_size"), raw.get("vocab_size")),
        layout=layout,
        verifier=verifier,
        raw=dict(raw),
    )


HIDDEN_ACTS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")  # the drafter MLP's (engine/drafter.py)


def _hidden_act(value: Any) -> str:
    if value not in HIDDEN_ACTS:
        raise ConfigError(
            f"draft config: hidden_act {value!r} is not one dflash-zoo's drafter runs ({', '.join(HIDDEN_ACTS)})"
        )
    return value


def _int(value: Any, key: str, minimum: int = 1) -> int:
    """A config integer: an int (or a float that is one), at least `minimum`; anything else is named."""
    if value is None:
        raise ConfigError(f"draft config is missing required field {key!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"draft config: {key} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"draft config: {key} must be >= {minimum}, got {value}")
    return value


def _float(value: Any, key: str) -> float:
    """A finite config number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"draft config: {key} must be a finite number, got {value!r}")
    return float(value)


def _taps(taps: Any, n_target: int | None, layers: int) -> tuple[tuple[int, ...], bool]:
    """(tap ids, whether they come from the default rule); explicit ids are kept as given, never corrected."""
    if taps is None:
        if n_target is None:
            raise ConfigError("config has neither target_layer_ids nor num_target_layers; cannot derive taps")
        return tuple(default_target_layer_ids(n_target, layers)), True
    if not isinstance(taps, list) or not taps:
        raise ConfigError(f"target_layer_ids must be a non-empty list of layer ids, got {taps!r}")
    ids = tuple(_int(t, "target_layer_ids entry", minimum=0) for t in taps)
    return ids, False


def _check_capture_ids(ids: Any, taps: tuple[int, ...]) -> None:
    """`eagle_aux_hidden_state_layer_ids` (vLLM's capture depths, Laguna configs carry both) must be the taps + 1:
    a config whose two spellings disagree names different target layers, and neither is picked silently."""
    if ids is None:
        return
    if not isinstance(ids, list) or [i - 1 if isinstance(i, int) else i for i in ids] != list(taps):
        raise ConfigError(
            f"eagle_aux_hidden_state_layer_ids {ids!r} do not match target_layer_ids {list(taps)} "
            "(capture depth k is the output of decoder layer k - 1)"
        )


def _draft_vocab(spec: drafters.ArchSpec, size: Any, vocab: int) -> int | None:
    """A reduced draft vocabulary's size (None: the target's whole vocabulary)."""
    if size is None or size == vocab:
        return None
    size = _int(size, "draft_vocab_size")
    if size > vocab:
        raise ConfigError(f"draft_vocab_size {size} exceeds the vocabulary ({vocab})")
    if spec is not drafters.DFLASH:  # DFlash 2's selector codebooks index the whole vocabulary
        raise ConfigError(f"a reduced draft vocabulary ({size} of {vocab}) runs with dflash drafters only")
    return size


def _dflash2(spec: drafters.ArchSpec, get, hidden: int, vocab: int) -> DFlash2Params | None:
    if spec is not drafters.DFLASH2:
        return None
    params = drafters.dflash2_params(get)
    if hidden % params.conv_group_size:
        raise ConfigError(f"conv_group_size {params.conv_group_size} does not divide hidden_size {hidden}")
    if params.selector_top_k > vocab:
        raise ConfigError(f"selector_top_k {params.selector_top_k} exceeds the vocabulary ({vocab})")
    return params


def _getter(raw: dict, dcfg: dict):
    """`dflash_config` wins over the top level (newer exports nest what older ones kept on top)."""

    def get(key: str, default: Any = None) -> Any:
        if dcfg.get(key) is not None:
            return dcfg[key]
        return raw.get(key) if raw.get(key) is not None else default

    return get


def _layer_types(raw: dict, layers: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:
        # Qwen3-style `use_sliding_window` + `max_window_layers`: layers >= max_window_layers slide.
        if raw.get("use_sliding_window") and raw.get("sliding_window"):
            start = _int(raw.get("max_window_layers", layers), "max_window_layers", minimum=0)
            return tuple(SLIDING if i >= start else FULL for i in range(layers))
        return (FULL,) * layers
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"draft config: layer_types must be a list of layer type names, got {types!r}")
    if len(types) != layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {layers} layers")
    bad = sorted({t for t in types if t not in (FULL, SLIDING)})
    if bad:
        raise ConfigError(f"unsupported draft layer type(s) {bad}; expected {FULL!r} or {SLIDING!r}")
    return tuple(types)


def _sliding_window(raw: dict, layer_types: tuple[str, ...]) -> int | None:
    if SLIDING not in layer_types:
        return None
    window = raw.get("sliding_window")
    if not window:
        raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
    return _int(window, "sliding_window")


def _causality(raw: dict, dcfg: dict, layer_types: tuple[str, ...]) -> tuple[bool, ...]:
    """Per-layer causality inside the block.

    Rule (newer z-lab upstream and vLLM `qwen3_dflash.py`): sliding layers are causal, full layers are
    bidirectional, unless the config says `causal` / `is_causal` explicitly (a bool or a per-layer list).
    """
    explicit = dcfg.get("causal", dcfg.get("is_causal", raw.get("is_causal")))
    if isinstance(explicit, bool):
        return (explicit,) * len(layer_types)
    if isinstance(explicit, list):
        if len(explicit) != len(layer_types):
            raise ConfigError(f"causal has {len(explicit)} entries for {len(layer_types)} layers")
        return tuple(bool(c) for c in explicit)
    return tuple(t == SLIDING for t in layer_types)


def _rope(raw: dict, layer_types: tuple[str, ...]) -> RopeSpec:
    params = _rope_parameters(raw, layer_types)
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"draft config: rope_scaling must be a JSON object, got {scaling!r}")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rtype = merged.get("rope_type", merged.get("type", "default"))
    if rtype not in _ROPE_TYPES:
        raise ConfigError(f"unsupported draft rope type {rtype!r}; supported: {', '.join(_ROPE_TYPES)}")
    fields = {k: merged[k] for k in RopeSpec.__dataclass_fields__ if k in merged and merged[k] is not None}
    fields.pop("type", None)
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return RopeSpec(
        **{**fields, "theta": _float(theta, "rope_theta"), "type": rtype,
           "partial_rotary_factor": _float(partial, "partial_rotary_factor")}
    )  # fmt: skip


def _rope_parameters(raw: dict, layer_types: tuple[str, ...]) -> dict:
    """The drafter's one set of rope parameters. transformers nests them by layer type for targets with two
    rotaries (Laguna, Gemma); vLLM's Laguna drafter reads the entry of its layers' type, and
    `swa_rope_parameters` for sliding layers where set. Layers of two types with different entries are refused:
    the drafter has one rotary embedding."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be a JSON object, got {params!r}")
    nested = any(isinstance(v, dict) for v in params.values())
    chosen = []
    for kind in dict.fromkeys(layer_types):
        entry = (params.get(kind) or params.get(FULL)) if nested else params
        if kind == SLIDING and raw.get("swa_rope_parameters"):
            entry = raw["swa_rope_parameters"]
        if not isinstance(entry, dict):
            raise ConfigError(f"rope_parameters has no entry for {kind} layers: {params!r}")
        chosen.append(dict(entry))
    if any(c != chosen[0] for c in chosen):
        raise ConfigError(f"draft layers of types {sorted(set(layer_types))} have different rope parameters")
    return chosen[0]
