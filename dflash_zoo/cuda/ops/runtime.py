"""What every kernel module shares: where the Triton kernels can run, the device's SM count, power-of-two tile
sizes, the tuner's switch and timer, and the guard every CUDA graph capture runs under.

The kernels run on CUDA, or anywhere under Triton's interpreter (`TRITON_INTERPRET=1`, the CPU tests), which
Triton reads itself: `interpreting` asks Triton rather than the environment. Triton is imported on first use
only, so importing an op module needs no triton.

Programmatic dependent launch (Hopper on): under `dependent_launches(True)` the kernels that take a `PDL`
flag (`launch_mode`) are launched so that they may start while the kernel before them drains; each lets the
next one start as it begins (`launch_kernels.allow_next`) and waits for the one before (`wait_previous`) before
it reads anything that kernel may have written. Only weights, which no step writes, are read before the wait.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (Triton's own `runtime.interpret` setting; a Triton
    without that setting, before 3.4, counts as not interpreting)."""
    try:
        import triton
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    return bool(knobs is not None and knobs.runtime.interpret)


def available(device: torch.device) -> str | None:
    """None when the kernels can run on `device`, else why not."""
    if device.type != "cuda" and not interpreting():
        return f"the Triton kernels need a CUDA device (got {device.type})"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the Triton kernels need the `triton` package"
    return None


def pow2(n: int, least: int = 16) -> int:
    """The smallest power of two >= n and >= `least` (Triton block sizes are powers of two)."""
    return max(least, 1 << (n - 1).bit_length())


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_DEPENDENT = contextvars.ContextVar("dflash_zoo_dependent_launch", default=False)


@contextlib.contextmanager
def dependent_launches(on: bool) -> Iterator[None]:
    """Kernels launched inside may start before the previous kernel ends (`launch_mode`), where `on`."""
    token = _DEPENDENT.set(on)
    try:
        yield
    finally:
        _DEPENDENT.reset(token)


def launch_mode(t: torch.Tensor) -> dict[str, Any]:
    """A `PDL`-flagged kernel's launch arguments for a launch on t's device: dependent (the flag, and Triton's
    `launch_pdl`) inside `dependent_launches(True)` on a CUDA GPU of compute capability >= 9.0, else not."""
    on = _DEPENDENT.get() and t.is_cuda and _capability_of(t.device.index or 0) >= (9, 0)
    return {"PDL": 1, "launch_pdl": True} if on else {"PDL": 0}


@functools.cache
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sms(t: torch.Tensor) -> int:
    """SMs of the tensor's GPU (8 under the interpreter: only the work split depends on it)."""
    return _sms_of(t.device.index or 0) if t.is_cuda else 8


def split_k(n: int, k: int, per_block: int, bk: int, per_sm: int, x: torch.Tensor) -> tuple[int, int, int]:
    """A split-K launch of n outputs over K: (output blocks, K slices, K per slice) for ~per_sm programs per SM
    on x's device, whole BK steps per slice."""
    out_blocks = -(-n // per_block)
    splits = max(1, min(-(-k // bk), -(-per_sm * sms(x) // out_blocks)))
    k_split = bk * -(-k // (splits * bk))
    return out_blocks, -(-k // k_split), k_split


def tunes(x: torch.Tensor, tune: bool = True) -> bool:
    """Whether the kernels' configs are timed for a tensor like `x`: with `tune` (`FastOptions.tune`), on CUDA,
    outside a graph capture (steps are warmed before capture). Without `tune` each kernel takes its first config
    untimed (the GPU tests: every config is tested on its own, and timing them all costs minutes per engine)."""
    return tune and x.is_cuda and not torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off (then as it was): a collection inside a capture can free another
    engine's CUDA graph, whose destruction is not permitted while a stream captures, and the capture fails
    ("operation failed due to a previous error during capture"; seen on one H100 when a second FP8 engine
    captured while the first was unreachable garbage). `torch.cuda.graph` collects once before it begins."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def graph_ms(fn: Callable[[], object], reps: int = 10, rounds: int = 3) -> float:
    """Milliseconds per call of `fn`, `reps` calls captured in one CUDA graph (launch cost as in a step): the
    median of `rounds` replays after an untimed one (a graph's first launch uploads it). With one timed first
    replay the tuners' picks changed more from process to process (docs/performance.md, FP8 targets)."""
    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with no_collection(), torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[rounds // 2]
