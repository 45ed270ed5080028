"""Target-family adapters, registered by Hugging Face `model_type` (installed as `dflash_zoo.adapters`).

Importing this package never imports torch, so `check` and `list` can ask which families are supported.
Each family module registers its adapter class with `@register(...)`; registering a name twice is an error.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import sys

from dflash_zoo.adapters.base import TargetAdapter

log = logging.getLogger("dflash_zoo")

_REGISTRY: dict[str, type[TargetAdapter]] = {}

# Alternative spellings seen in the wild -> the registered model_type (mlx-lm MODEL_REMAPPING style).
ALIASES: dict[str, str] = {}

# One module per family; modules whose transformers classes may be missing register inside try/except.
FAMILY_MODULES = (
    "qwen3",
    "qwen3_moe",
    "llama",
    "qwen3_5_text",
    "qwen3_5",
    "qwen3_5_moe_text",
    "qwen3_5_moe",
    "qwen3_next",
    "gpt_oss",
    "gemma4_text",
    "gemma4",
    "deepseek_v3",
    "kimi_k25",
    "minimax_m2",
    "qwen3_vl",
    "muse_glimmer",
    "glm_moe_dsa",
    "laguna",
    "gemma4_unified",
)


def register(*model_types: str):
    """Class decorator: register an adapter under one or more model types."""

    def wrap(cls: type[TargetAdapter]) -> type[TargetAdapter]:
        for name in model_types:
            if name in _REGISTRY:
                raise ValueError(f"adapter for model_type {name!r} registered twice")
            _REGISTRY[name] = cls
        cls.model_types = tuple(model_types)
        return cls

    return wrap


def _load_families() -> None:
    for mod in FAMILY_MODULES:
        if f"{__name__}.{mod}" in sys.modules:
            continue
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ImportError as exc:  # an old transformers lacks the family: degrade to "unsupported"
            log.debug("adapter module %s unavailable: %s", mod, exc)


def canonical_model_type(model_type: str) -> str:
    """Resolve aliases (`ALIASES`) to the registered model type."""
    return ALIASES.get(model_type, model_type)


def supported_model_types() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


def find_adapter(model_type: str) -> type[TargetAdapter] | None:
    """The adapter class for a model type (through aliases), or None."""
    _load_families()
    return _REGISTRY.get(canonical_model_type(model_type))


def get_adapter(model_type: str) -> type[TargetAdapter]:
    """Like `find_adapter`, but raises a clear error naming the nearest supported types."""
    cls = find_adapter(model_type)
    if cls is None:
        from dflash_zoo.errors import UnsupportedModelError

        near = difflib.get_close_matches(model_type, supported_model_types(), n=3, cutoff=0.4)
        hint = (
            f"nearest supported: {', '.join(near)}" if near else "run `dflash-zoo list` for supported pairs"
        )
        raise UnsupportedModelError(f"no dflash-zoo adapter for model_type {model_type!r}", hint=hint)
    return cls


__all__ = [
    "ALIASES",
    "TargetAdapter",
    "canonical_model_type",
    "find_adapter",
    "get_adapter",
    "register",
    "supported_model_types",
]
