"""Gated MLPs of the static engine (the target's dense MLPs and shared experts, the drafter's MLPs):
down(act(gate(x)) * up(x)) over a fused gate/up projection.

One row through the GEMV kernels: the down kernel computes act(gate) * up itself from gate/up's partial sums
(no kernel adds them up or multiplies them first) and, for one row with `fold`, leaves its own partial sums to
the next residual add (`Parts`). Otherwise act(gate) * up is one kernel where `swiglu` (`ops.fused.silu_mul`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dflash_zoo.cuda.ops import fused
from dflash_zoo.cuda.static.linear import OFF, FusedLinear, Gemv, Parts, apply, project, project_sums


@dataclass(frozen=True)
class MLPKernels:
    """Which kernels a gated MLP runs through: `gate_act` the activation as the GEMV computes it
    (`gemv_ops.ACTS`; 0: it cannot), `gemv` the few-row projections, `swiglu` SiLU(gate) * up in one kernel."""

    gate_act: int = 0
    gemv: Gemv = OFF
    swiglu: bool = False


def swiglu(act: Callable, gate: torch.Tensor, up: torch.Tensor, kernel: bool) -> torch.Tensor:
    """act(gate) * up; with `kernel` (act is SiLU), one kernel over the strided halves (`fused.silu_mul`)."""
    return fused.silu_mul(gate, up) if kernel else act(gate) * up


def swiglu_mlp(k: MLPKernels, gate_up: FusedLinear, down: nn.Linear, act: Callable, x, fold: bool = False):
    """down(act(gate(x)) * up(x)) over x [..., H]; for one row with `fold`, as `Parts`. One row through the GEMV
    kernels: the down kernel reads gate/up's partial sums itself (no kernel adds them up first)."""
    sums = gate_up.parts(x) if k.gate_act and k.gemv.on else None  # [S, 1, 2F] fp32
    if sums is None:
        return swiglu_down(k, *gate_up(x), down, act, fold)
    f = down.in_features
    gate, up = sums[..., :f], sums[..., f:]
    # (`parts` is None while traced)
    out = project_sums(down, up, gate, k.gate_act, k.gemv, fold, x.dtype)
    return out if isinstance(out, Parts) else out.view(*x.shape[:-1], -1)


def swiglu_down(k: MLPKernels, gate, up, down: nn.Linear, act: Callable, fold: bool = False):
    """down(act(gate) * up) for the gate and up outputs [..., F], as `swiglu_mlp`."""
    # act(gate) * up computed inside the GEMV kernel, where it computes that activation
    projected = project(down, up, gate, k.gemv, fold, k.gate_act) if k.gate_act else None
    return apply(down, swiglu(act, gate, up, k.swiglu), k.gemv) if projected is None else projected
