"""The one place that decides which engine runs a generation, and says why.

The static engine (`cuda/fast.py`) runs when the target sits whole on one CUDA device, its adapter declares a
static layout, and the prompt carries no prefill-only inputs (images); a layout not yet verified on CUDA
(`StaticLayout.cuda_verified`) runs there only when asked for (`fast=True`). Everything else runs the eager engine
(`engine/decode.py`), which serves every family, device and placement. Greedy and sampling, streaming or not,
what-if acceptance and smaller block sizes are all served by both, so they never decide the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import TargetAdapter


@dataclass(frozen=True)
class EngineOptions:
    """What the caller asks for. fast: True (static engine wherever it can run, CPU included: no graphs
    there), False (always eager), None (auto: the static engine on CUDA). compile: `torch.compile` its steps."""

    fast: bool | None = None
    compile: bool = False


@dataclass(frozen=True)
class EngineChoice:
    """The engine picked ("fast" or "eager") and why, for logs, `bench` records and `--verbose`."""

    name: str
    reason: str

    @property
    def fast(self) -> bool:
        return self.name == "fast"


def choose_engine(
    adapter: TargetAdapter,
    device: Any,
    options: EngineOptions,
    *,
    split: bool = False,
    prefill_inputs: bool = False,
) -> EngineChoice:
    """Pick the engine for one generation.

    Args:
        adapter: the target's adapter (its static layout decides whether the static engine can run it).
        device: where the target runs (a `torch.device` or its name).
        options: the caller's `EngineOptions`.
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
    else:
        from dflash_zoo.cuda.static.layout import cuda_unverified_reason
        from dflash_zoo.cuda.static.target import unsupported_reason

        reason = unsupported_reason(adapter, graphs=cuda)
        unverified = cuda_unverified_reason(adapter) if cuda and options.fast is None else None
        if reason is None and unverified is not None:
            return EngineChoice("eager", f"auto: {unverified} (fast=True runs it)")
    if reason is not None:
        return EngineChoice("eager", f"fast engine unavailable: {reason}")
    return EngineChoice(
        "fast", "static buffers and CUDA graphs" if cuda else "static buffers (no graphs off CUDA)"
    )
