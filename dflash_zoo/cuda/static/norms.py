"""RMSNorms of the static engine, in the formula the target's layout declares (`StaticLayout.norms`).

`Norms` runs an HF (or drafter) norm module as the module itself, as `weight * F.rms_norm(x)` (`fast_norm`:
bit-identical to HF's Qwen3/Llama RMSNorm on CPU in fp32 and bf16, the weight multiply outside in the input
dtype as HF does, in 2 kernels instead of ~7), or in one kernel (`ops.fused.rms_norm`, `kernel`). `add` is the
residual add before a norm, in the same kernel where it runs, summing a one-row GEMV's `Parts` too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_zoo.cuda.ops import fused
from dflash_zoo.cuda.static.linear import Parts, plus
from dflash_zoo.cuda.static.lookup import norm_eps

# `StaticLayout.norms` formulas that are not Llama's: (weight multiplied in fp32, offset added to the weight)
FP32_NORMS = {"fp32_weight": 0.0, "fp32_one_plus_weight": 1.0}


class Norms:
    """RMSNorm over HF / drafter norm modules: the module itself, or `weight * F.rms_norm(x)` (same numerics),
    or the declared formula in one kernel (`fused.rms_norm`, `kernel`)."""

    def __init__(self, eps: float, fast: bool, kernel: bool = False, formula: str = "llama"):
        if formula != "llama" and formula not in FP32_NORMS:
            raise ValueError(f"unknown norm formula {formula!r} in the static layout")
        self.eps, self.fast, self.kernel = eps, fast, kernel
        self.fp32 = formula in FP32_NORMS
        self.offset = FP32_NORMS.get(formula, 0.0)

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = getattr(module, "weight", None)  # a weightless norm (Gemma's value norm) runs as its module
        if self.kernel and weight is not None and weight.dtype == x.dtype:
            eps = norm_eps(module, self.eps)
            return fused.rms_norm(x, weight, eps, self.fp32, self.offset)
        if not self.fast:
            return module(x)
        # HF: weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype); rms_norm without a weight returns that
        # cast value, and the weight multiply stays in the input dtype (folding it in would round differently)
        return module.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps)

    def fuses(self, module: nn.Module | None, dtype: torch.dtype) -> bool:
        """Whether `add` runs as one kernel for this norm module and dtype."""
        weight = getattr(module, "weight", None)
        return self.kernel and weight is not None and weight.dtype == dtype

    def add(self, module: nn.Module, x: torch.Tensor, delta: torch.Tensor | Parts | None):
        """(x + delta, the norm of that sum); delta None: (x, its norm). One kernel where `fuses`
        (`fused.add_rms_norm`), which also sums a GEMV's `Parts`."""
        if delta is None:
            return x, self(module, x)
        if self.fuses(module, x.dtype):
            eps = norm_eps(module, self.eps)
            parts = isinstance(delta, Parts)
            d, bias, more = (delta.sums, delta.bias, delta.more) if parts else (delta, None, None)
            return fused.add_rms_norm(x, d, module.weight, eps, self.fp32, self.offset, parts, bias, more)
        x = plus(x, delta)
        return x, self(module, x)
