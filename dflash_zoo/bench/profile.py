"""`bench --profile`: where a fast-path step's time goes, measured on the engine the bench just ran.

For each step of the fast engine (the autoregressive step, the DFlash step, and the DFlash step's drafter part
captured on its own, with and without the draft logits) after a prefill of the bench prompt:
- time per step: replays back to back with no host work between them (CUDA events on a GPU, the wall clock on
  a CPU), so it is the device's time for the step, without the host's read-back that tok/s includes;
- on CUDA, from `torch.profiler`: kernels per step, kernel time per step and the kernels that take the most.
The drafter's share of a DFlash step is its forward's time over the whole step's; the draft share adds the
draft logits (the target's LM head over the block) and the draft selection.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import torch

# "draft": the drafter's part of a spec step captured on its own (its forward, the draft logits through the
# target's LM head, the drafts); "drafter": its forward alone
STEPS = ("ar", "spec", "draft", "drafter")


def _ms_per_step(run: Callable[[int], None], n: int, device: torch.device) -> float:
    if device.type != "cuda":
        t0 = time.perf_counter()
        run(n)
        return 1e3 * (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(n)
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / n


def _kernels(run: Callable[[int], None], n: int, device: torch.device, top: int) -> dict[str, Any]:
    """Kernels per step, kernel time per step and the `top` kernels by time (CUDA activity of `n` steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(n)
        torch.cuda.synchronize(device)
    times: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.device_time > 0:
            name = ev.name[:100]
            times[name] += ev.device_time
            counts[name] += 1
    return {
        "kernels_per_step": sum(counts.values()) / n,
        "kernel_us_per_step": sum(times.values()) / n,
        "top": [
            {"kernel": k, "us_per_step": round(t / n, 2), "per_step": counts[k] / n}
            for k, t in times.most_common(top)
        ],
    }


def profile_steps(eng: Any, prompt: list[int], cfg: Any, replays: int = 40, top: int = 12) -> dict[str, Any]:
    """Per-step time (and on CUDA a kernel profile) of `eng`'s steps for `prompt` under `cfg` (a FastEngine)."""
    # each spec or ar replay commits one position: timing and profiling must both fit past the prompt
    room = (eng.size - len(prompt) - 2 * eng.block) // 2
    n = max(1, min(replays, room))
    out: dict[str, Any] = {"replays": n}
    for step in STEPS:
        run = eng.replays(prompt, cfg, step)
        out[step] = {"ms_per_step": _ms_per_step(run, n, eng.device)}
        if eng.device.type == "cuda" and eng.graphs:
            out[step] |= _kernels(run, max(1, min(10, n)), eng.device, top)
    # what the drafter costs of a DFlash step: its network alone, and with the draft logits and selection
    out["drafter_share"] = out["drafter"]["ms_per_step"] / out["spec"]["ms_per_step"]
    out["draft_share"] = out["draft"]["ms_per_step"] / out["spec"]["ms_per_step"]
    return out
