"""Drafter architectures, registered by the `architectures` entry of a drafter's `config.json`.

What `adapters/` is for targets, this package is for drafters: one entry per architecture, picked from the
config, each with the config keys it needs and the module that builds it. Importing this package never imports
torch (`check`, `info` and `list` name a drafter's architecture without it); `build` imports the model module.

Architectures (docs/method.md, "Drafter architectures"):
- `dflash` (`DFlashDraftModel`): the DFlash drafter of the paper (engine/drafter.py). A config that sets
  `dflash_config.causal: true` (NeMo's JetSpec export) is the same architecture with causal attention inside
  the block, reported as the variant "in-block causal".
- `dflash2` (`DFlash2DraftModel`): DFlash 2, a grouped dynamic causal convolution around every sublayer and a
  candidate selector over the top-k drafter logits (drafters/dflash2.py).
- `laguna_dflash` (`DFlashLagunaForCausalLM`): poolside's DFlash drafters for Laguna targets, DFlash layers with
  a softplus gate on the attention output, one RMSNorm per tapped target layer before `fc`, and the context
  through each layer's input norm (drafters/laguna_dflash.py).

Anything else is refused by name: a drafter is never run as an architecture it is not.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from dflash_zoo.errors import DrafterFormatError


@dataclass(frozen=True)
class DFlash2Params:
    """DFlash 2's own shape parameters (z-lab `dflash_config` keys, or top-level)."""

    conv_kernel_size: int  # K taps of each convolution along the block
    conv_group_size: int  # g channels share one dynamic coefficient (H / g groups)
    selector_rank: int  # r, the rank of the selector's transition score
    selector_top_k: int  # k candidates per slot the selector chooses among


@dataclass(frozen=True)
class ArchSpec:
    """One drafter architecture: how a config names it, what it needs, where its model class lives."""

    name: str
    architectures: tuple[str, ...]  # `config.json` `architectures` values that select it
    model: str  # "module:Class" of the nn.Module, imported lazily by `build`
    summary: str
    static_fast_path: bool  # the fast engine's static drafter runs it (else the eager engine does)
    model_type: str = "qwen3"  # the `model_type` its config.json is written with

    def model_class(self) -> Any:
        module, _, cls = self.model.partition(":")
        return getattr(importlib.import_module(module), cls)


DFLASH = ArchSpec(
    name="dflash",
    architectures=("DFlashDraftModel",),
    model="dflash_zoo.engine.drafter:DFlashDrafter",
    summary="DFlash: Qwen3-style layers with target features injected into every layer's K/V",
    static_fast_path=True,
)
DFLASH2 = ArchSpec(
    name="dflash2",
    architectures=("DFlash2DraftModel",),
    model="dflash_zoo.drafters.dflash2:DFlash2Drafter",
    summary="DFlash 2: DFlash layers in grouped dynamic causal convolutions, plus a candidate selector",
    static_fast_path=True,
)
LAGUNA = ArchSpec(
    name="laguna_dflash",
    architectures=("DFlashLagunaForCausalLM",),
    model="dflash_zoo.drafters.laguna_dflash:LagunaDrafter",
    summary="Laguna DFlash: DFlash layers with gated attention output, per-tap norms, normed context",
    static_fast_path=False,
    model_type="laguna",
)
ARCHS: dict[str, ArchSpec] = {a.name: a for a in (DFLASH, DFLASH2, LAGUNA)}
# the output gates a Laguna drafter's `gating` names (True is per-head, False none)
GATES = ("per-head", "per-element")
_BY_ARCHITECTURE = {arch: spec for spec in ARCHS.values() for arch in spec.architectures}

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def arch_names() -> list[str]:
    return sorted(ARCHS)


def arch_of(raw: dict[str, Any], get: Any) -> ArchSpec:
    """The architecture a raw drafter config declares; `get(key)` reads `dflash_config` first, then the top.

    A config without `architectures` is an early DFlash export (Jan 2026). DFlash 2 keys on a config that
    declares another architecture are refused, not ignored: the drafter would run without its convolutions.
    """
    declared = raw.get("architectures") or ["DFlashDraftModel"]
    if not isinstance(declared, list) or not all(isinstance(a, str) for a in declared):
        raise DrafterFormatError(f"config `architectures` must be a list of names, got {declared!r}")
    known = [_BY_ARCHITECTURE[a] for a in declared if a in _BY_ARCHITECTURE]
    if not known:
        raise DrafterFormatError(
            f"unknown drafter architecture {', '.join(declared)}; dflash-zoo runs "
            + ", ".join(f"{a} ({s.name})" for a, s in _BY_ARCHITECTURE.items()),
            hint="a drafter in another layout converts with `dflash-zoo convert SRC --to zlab OUT`",
        )
    spec = known[0]
    foreign = _foreign(raw)
    if foreign:
        raise DrafterFormatError(f"this config describes {foreign}, which dflash-zoo does not run")
    present = [k for k in DFLASH2_KEYS if get(k) is not None]
    if spec is DFLASH and present:
        raise DrafterFormatError(
            f"config declares DFlashDraftModel but sets DFlash 2 keys ({', '.join(present)})",
            hint='set "architectures": ["DFlash2DraftModel"] if this is a DFlash 2 drafter',
        )
    return spec


def _foreign(raw: dict[str, Any]) -> str | None:
    """Another drafter family in a DFlash-like config (speculators / NeMo exports), or None."""
    dcfg = raw.get("dflash_config") or {}
    keys = [*raw, *dcfg]
    if any(k.startswith("markov_") for k in keys):
        return "a DSpark drafter (a Markov head over the block)"
    if "domino" in (raw.get("projector_type"), dcfg.get("projector_type")):
        return "a Domino drafter (a causal correction head)"
    return None


def dflash2_params(get: Any) -> DFlash2Params:
    """DFlash 2's parameters, each a positive integer; a missing one is named."""
    missing = [k for k in DFLASH2_KEYS if get(k) is None]
    if missing:
        raise DrafterFormatError(
            f"DFlash 2 config is missing {', '.join(missing)}",
            hint="they sit in dflash_config (z-lab) or at the top level (speculators / SpecForge exports)",
        )
    values = {}
    for key in DFLASH2_KEYS:
        value = get(key)
        if isinstance(value, float) and value.is_integer():  # as every other integer field of a config
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DrafterFormatError(f"DFlash 2 config: {key} must be a positive integer, got {value!r}")
        values[key] = value
    return DFlash2Params(**values)


def attention_gate(spec: ArchSpec, value: Any) -> str | None:
    """A Laguna drafter's output gate from its `gating` key (absent or True: "per-head"; False or "disabled":
    none); other architectures have none, and a `gating` they set is refused, not ignored."""
    if spec is not LAGUNA:
        if value not in (None, False, "disabled"):
            raise DrafterFormatError(f"config sets gating {value!r}, which only DFlashLagunaForCausalLM has")
        return None
    if value is None or value is True:
        return "per-head"
    if value is False or value == "disabled":
        return None
    if value not in GATES:
        raise DrafterFormatError(f"unknown gating {value!r}; Laguna drafters gate per-head or per-element")
    return value


def variant(spec: ArchSpec, causal: tuple[bool, ...], layer_types: tuple[str, ...]) -> str:
    """The name `check` and `info` print: the architecture, plus "in-block causal" for JetSpec-style configs."""
    forced = any(c and t == "full_attention" for c, t in zip(causal, layer_types, strict=True))
    return f"{spec.name} (in-block causal)" if forced else spec.name


def build(cfg: Any) -> Any:
    """The drafter nn.Module for a `DraftConfig`, on the current default device (e.g. under torch.device("meta"))."""
    return ARCHS[cfg.arch].model_class()(cfg)
