"""The fast-vs-eager matrix: every registered adapter that declares a `static_layout`, with its tiny pair.

Tests that compare the static engine with the eager loop parametrise over `STATIC_MODEL_TYPES`, so a family
that opts into the fast path (adapters/<model_type>.py) is compared automatically; its tiny config comes from
`tests/tiny_families/<model_type>.py` like every other family's.
"""

from __future__ import annotations

from typing import Any

from dflash_zoo.adapters import find_adapter, supported_model_types

from dflash_zoo.engine.options import FastOptions
from tests.tiny import tiny_drafter, tiny_target

# the families the fast path covered when the layout was introduced: the matrix may grow, never lose them
REQUIRED = ("llama", "qwen3", "qwen3_moe")


def static_model_types() -> list[str]:
    """Registered model types whose adapter declares a static layout (sorted)."""
    return [t for t in supported_model_types() if find_adapter(t).static_layout is not None]


STATIC_MODEL_TYPES = static_model_types()
# the rest: every generation of theirs runs the eager engine
EAGER_ONLY_MODEL_TYPES = [t for t in supported_model_types() if t not in STATIC_MODEL_TYPES]


def static_pair(model_type: str, device: str = "cpu", **overrides):
    """(adapter, drafter) of a tiny fp32 pair of `model_type`: target seed 0, drafter seed 1 tapping layers 0, 2."""
    target = tiny_target(model_type, seed=0, **overrides).to(device)
    drafter = tiny_drafter(target, seed=1, taps=[0, 2]).to(device)
    return find_adapter(model_type)(target), drafter


def fast_engine(adapter, drafter, mask: int, max_len: int, *, block_size: int | None = None, **choices: Any):
    """A static engine (built directly: the engine under test) with `FastOptions.from_env(**choices)`: the
    environment's switches (conftest's `DFLASH_ZOO_TUNE=0` on a GPU) under the test's own choices."""
    from dflash_zoo.cuda.static.fast import FastEngine

    return FastEngine(adapter, drafter, mask, max_len, FastOptions.from_env(**choices), block_size)
