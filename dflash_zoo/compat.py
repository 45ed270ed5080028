"""The one place that knows how transformers changed between 5.17 and the newest release (docs/compat.md).

- cache kwarg: `past_key_values=` (5.17) vs `cache=` (newer). Passing `cache=` to 5.17 is silently ignored,
  so the name is read from the `forward` signature, never assumed;
- the returned cache: `out.past_key_values` (5.17) or `out.cache` (newer);
- `Cache.crop`: only negative counts (positive raises from 5.20);
- `cache_position` is gone: positions derive from the cache length; batch size 1 passes no mask/positions;
- linear-attention cache layers (5.25): `activate_past_recording(recurrent_states_to_keep=...)` makes a
  verify keep per-token recurrent states for the layer's own `crop`, and the layer counts its tokens
  (`cumulative_length_linear`, which `get_seq_length` reads when layer 0 is linear). The hybrid adapters roll
  back themselves, so they keep no states (`record_past`) and set a rolled-back layer's state, window and
  count directly (`set_linear_state`).
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


def record_past(cache: Any) -> None:
    """Turn on the cache's past recording (sliding layers keep evicted rows and linear layers their conv
    inputs until `crop`). From 5.25 the linear layers take how many recurrent states to keep; their default
    (None) breaks a multi-token forward there, and the hybrid adapters need none (they roll back themselves)."""
    if not hasattr(cache, "activate_past_recording"):
        return
    params = inspect.signature(cache.activate_past_recording).parameters.values()
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    cache.activate_past_recording(**({"recurrent_states_to_keep": 0} if takes_kwargs else {}))


def set_linear_state(layer: Any, window: torch.Tensor, state: torch.Tensor, dropped: int) -> None:
    """Put a linear-attention cache layer at conv window [B, C, K] and recurrent state [B, H, Dk, Dv] after
    `dropped` of the tokens it has seen are taken back: what its own `crop` does where it kept the states."""
    layer.conv_states[0] = window
    layer.recurrent_states[0].copy_(state)
    count = getattr(layer, "cumulative_length_linear", None)  # 5.25: the layer's token count
    if count is not None:
        count.sub_(dropped)
    history = getattr(layer, "recurrent_states_history", None)  # 5.25: states kept for its crop, now stale
    if history is not None:
        history[0] = []


def transformers_version() -> str:
    import transformers

    return transformers.__version__
