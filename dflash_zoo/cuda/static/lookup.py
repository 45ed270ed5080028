"""Finding a target's modules by the dotted names its adapter declares, with errors that name what is missing.

A layout that names a module the target lacks fails when the engine is built, with the adapter, the layer
and the name, rather than deep inside a step.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

from torch import nn

from dflash_zoo.engine.static_support import adapter_name
from dflash_zoo.errors import UnsupportedModelError

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import TargetAdapter


def lookup(adapter: TargetAdapter, obj: Any, path: str, where: str) -> Any:
    """`obj.<path>` (dotted), or an error naming the adapter, the place and the missing name."""
    try:
        return operator.attrgetter(path)(obj)
    except AttributeError:
        raise UnsupportedModelError(
            f"the static layout of the {adapter_name(adapter)} adapter names {where}.{path}, "
            f"which this target ({type(obj).__name__}) does not have",
            hint=f"fix `static_layout` in {type(adapter).__module__}, or set it to None (the eager loop runs it)",
        ) from None


def lookup_linear(adapter: TargetAdapter, obj: Any, path: str, where: str) -> nn.Linear:
    """`lookup` of a projection, which must be an `nn.Linear` (fusion and the GEMV read weight / bias /
    out_features)."""
    mod = lookup(adapter, obj, path, where)
    if not isinstance(mod, nn.Linear):
        raise UnsupportedModelError(
            f"the static layout of the {adapter_name(adapter)} adapter names {where}.{path} as a projection, "
            f"but it is a {type(mod).__name__}, not an nn.Linear",
            hint=f"fix `static_layout` in {type(adapter).__module__}",
        )
    return mod


def norm_eps(norm: nn.Module, default: float | None = None) -> float | None:
    """An RMSNorm module's epsilon: `variance_epsilon` (most HF norms, Gemma 4's from transformers 5.25) or
    `eps` (Gemma 4's before it)."""
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", default))
