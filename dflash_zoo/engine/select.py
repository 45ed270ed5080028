"""The one place that decides which engine runs a generation, and says why.

The static engine (`cuda/static/fast.py`) runs when the target sits whole on one CUDA device, its adapter
declares a static layout, the drafter's architecture has a static drafter (`static_supported`), and the prompt
carries no prefill-only inputs (images); a layout not yet verified on CUDA (`StaticLayout.cuda_verified`) runs
there only when asked for (`fast=True`). Everything else runs the eager engine (`engine/decode.py`), which serves
every family, drafter, device and placement. Greedy and sampling, streaming or not, what-if acceptance and
smaller block sizes are all served by both, so they never decide the engine. The answers about the static
engine come from `static_support.py` (declarations only: nothing here loads the CUDA wing); `factory.py`
builds the engine chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dflash_zoo.engine.options import EngineOptions
from dflash_zoo.engine.static_support import cuda_unverified_reason, drafter_reason, unsupported_reason
from dflash_zoo.quantization import fp8_unverified_reason, quantized_reason

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import TargetAdapter

__all__ = ["EngineChoice", "EngineOptions", "choose_engine"]


@dataclass(frozen=True)
class EngineChoice:
    """The engine picked ("fast" or "eager") and why, for logs, `bench` records and `--verbose`."""

    name: str
    reason: str
    drafter: str | None = None  # the drafter's architecture as `check` names it ("dflash", "dflash2", ...)

    @property
    def fast(self) -> bool:
        return self.name == "fast"


def choose_engine(
    adapter: TargetAdapter,
    device: Any,
    options: EngineOptions,
    *,
    drafter: Any = None,
    split: bool = False,
    prefill_inputs: bool = False,
) -> EngineChoice:
    """Pick the engine for one generation (`_choose`), naming the drafter's architecture in the choice."""
    choice = _choose(adapter, device, options, drafter=drafter, split=split, prefill_inputs=prefill_inputs)
    return choice if drafter is None else replace(choice, drafter=drafter.cfg.variant)


def _choose(
    adapter: TargetAdapter,
    device: Any,
    options: EngineOptions,
    *,
    drafter: Any = None,
    split: bool = False,
    prefill_inputs: bool = False,
) -> EngineChoice:
    """Pick the engine for one generation.

    Args:
        adapter: the target's adapter (its static layout decides whether the static engine can run it).
        device: where the target runs (a `torch.device` or its name).
        options: the caller's `EngineOptions`.
        drafter: the drafter (its class's `static_supported` decides whether the static drafter runs it);
            None: not known yet (a target-only question, as `bench` asks before it has a drafter).
        split: the target is split across devices (CUDA graphs and static buffers need one device).
        prefill_inputs: the prompt has prefill-only inputs (image pixels), which the static engine does not take.
    """
    if options.fast is False:
        return EngineChoice("eager", "the fast engine was turned off (fast=False)")
    cuda = str(device).startswith("cuda")
    if options.fast is None and not cuda:
        return EngineChoice("eager", f"auto: the fast engine runs on CUDA by default, this is {device}")
    reason = None
    if split:
        reason = "the target is split across devices (the fast engine needs it on one)"
    elif prefill_inputs:
        reason = "image inputs run on the eager engine"
    elif options.fast_options.graphs and not cuda:
        reason = f"fast_options.graphs=True captures CUDA graphs, and this is {device}"
    else:
        graphs = options.fast_options.graphs
        reason = unsupported_reason(adapter, graphs=cuda if graphs is None else graphs)
        reason = reason or quantized_reason(adapter)  # quantized: block-wise FP8 only, where its kernels run
        if reason is None and drafter is not None:
            reason = drafter_reason(drafter)
        auto_cuda = cuda and options.fast is None
        unverified = (
            (cuda_unverified_reason(adapter) or fp8_unverified_reason(adapter)) if auto_cuda else None
        )
        if reason is None and unverified is not None:
            return EngineChoice("eager", f"auto: {unverified} (fast=True runs it)")
    if reason is not None:
        return EngineChoice("eager", f"fast engine unavailable: {reason}")
    return EngineChoice(
        "fast", "static buffers and CUDA graphs" if cuda else "static buffers (no graphs off CUDA)"
    )
