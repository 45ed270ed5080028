"""The one place that knows how transformers changed between 5.17 and the newest release (docs/compat.md).

- cache kwarg: `past_key_values=` (5.17) vs `cache=` (newer). Passing `cache=` to 5.17 is silently ignored,
  so the name is read from the `forward` signature, never assumed;
- the returned cache: `out.past_key_values` (5.17) or `out.cache` (newer);
- `Cache.crop`: only negative counts (positive raises from 5.20);
- `cache_position` is gone: positions derive from the cache length; batch size 1 passes no mask/positions.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


@functools.cache
def _cache_kwarg_for(forward_fn: Any) -> str:
    params = inspect.signature(forward_fn).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model: torch.nn.Module) -> str:
    """`cache` where `forward` takes it, else `past_key_values`."""
    return _cache_kwarg_for(type(model).forward)


def new_cache(config: Any) -> Any:
    """A `DynamicCache` built from the config (right layer classes for sliding and linear layers)."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


def forward(
    model: torch.nn.Module, ids: torch.Tensor, cache: Any, logits_to_keep: int = 0, **kw: Any
) -> torch.Tensor:
    """Run `model` on `ids` [1, T] appending to `cache`; returns logits [1, T or logits_to_keep, V]."""
    name = cache_kwarg(model)
    kwargs = {name: cache, "use_cache": True, **kw}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    out = model(input_ids=ids, **kwargs)
    returned = out.get(name)  # ModelOutput is dict-like; the attribute form warns on newer releases
    if returned is not None and returned is not cache:
        raise RuntimeError("the target created a new cache instead of using ours (cache kwarg mismatch)")
    return out.logits


def transformers_version() -> str:
    import transformers

    return transformers.__version__
