"""The one place an engine is built: `build_engine` asks `select.choose_engine` which engine runs the pair and
builds it, the eager engine (engine/decode.py) or the static one (cuda/static/fast.py).

Every entry point takes its engine from here: the Python API (`pipeline.py`, and through it the CLI's
`generate`, `chat` and `eval`) and `bench` (bench/runner.py). A test that greps the source tree keeps it so
(tests/test_layering.py).

Layering (imports point down this list only; tests/test_layering.py checks it):
1. `errors`, `output`, `paths`, `compat`: no other dflash_zoo module;
2. `cuda.ops`: kernels and their torch forms, knowing nothing of models or engines;
3. `adapters`, `drafters`: what a target or drafter family declares;
4. `engine`: the engine interface, the eager engine, sampling, selection, options, checkpoints;
5. `cuda.static`, `cuda.placement`: the static engine, and splitting a target over devices;
6. `zoo`, `training`: the registry and Hub client; the trainer and `eval`;
7. `bench`, then `pipeline` / `loading` / `api`, then `commands` and `cli`.
`engine` reaches up in one place only, here: the static engine is imported when one is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflash_zoo.engine.decode import EagerEngine
from dflash_zoo.engine.run import Engine
from dflash_zoo.engine.select import EngineChoice, EngineOptions, choose_engine

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import TargetAdapter


def build_engine(
    adapter: TargetAdapter,
    drafter: Any,
    mask_token_id: int,
    options: EngineOptions,
    max_len: int,
    *,
    block_size: int | None = None,
    split: bool = False,
    prefill_inputs: bool = False,
    choice: EngineChoice | None = None,
    require: str | None = None,
) -> tuple[Engine, EngineChoice]:
    """Choose the engine for a (target, drafter) pair and build it.

    Args:
        adapter / drafter / mask_token_id: the pair and the drafter's mask token.
        options: which engine is asked for, and how the static engine runs (`EngineOptions`).
        max_len: the longest prompt + new tokens the engine will see (the static engine's buffers).
        block_size: the verify block (None: the drafter's trained block).
        split / prefill_inputs: the target spans devices / the prompt has image inputs (`choose_engine`).
        choice: a choice already made for this pair (the pipeline's, which reuses engines); None: choose here.
        require: "fast" or "eager": refuse (`ValueError` with the reason) if the choice is another engine.
    Returns:
        (the engine, the choice with its reason).
    """
    if choice is None:
        device = next(drafter.parameters()).device
        choice = choose_engine(
            adapter, device, options, drafter=drafter, split=split, prefill_inputs=prefill_inputs
        )
    if require is not None and choice.name != require:
        raise ValueError(f"the {require} engine cannot run this pair: {choice.reason}")
    if not choice.fast:
        return EagerEngine(adapter, drafter, mask_token_id), choice
    from dflash_zoo.cuda.static.fast import FastEngine  # the one import up the layers (module docstring)

    return FastEngine(adapter, drafter, mask_token_id, max_len, options.fast_options, block_size), choice
