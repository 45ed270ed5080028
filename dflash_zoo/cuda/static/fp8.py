"""FP8 projections in the static engine: which projection modules hold FP8 weights, what the engine reads of
them, and how they run (`FastOptions.fp8`, one of `engine.options.FP8`, resolved in `Kernels.fp8`).

A projection is FP8 where its `weight` is float8_e4m3fn: the engine then reads that weight, its block scales
`weight_scale_inv` (fp32 [ceil(N/128), ceil(K/128)]: transformers' `FP8Linear`, checked when the engine is
built) and its bias, and never calls the module, whose forward fetches a kernel from the Hub. Modes:
- "weight_only": the FP8 kernels (`ops.fp8`), reading the FP8 weight: the default where the Triton kernels run;
- "w8a8": the same, with steps of 2+ rows on the FP8 tensor cores (activations quantized per 128 columns);
- "torch": dequantize, then matmul in fp32 (`ops.fp8.reference`): the reference, and the path elsewhere.
Which FP8 modules a target may hold for the engine to run it: `quantization.fp8_modules_reason`.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_zoo.cuda.ops import fp8 as fp8_ops

SCALES = "weight_scale_inv"  # the block scales' attribute: transformers' `FP8Linear`


def scales(m: nn.Module) -> torch.Tensor | None:
    """A projection's block scales where its weight is FP8 (float8_e4m3fn), else None."""
    return getattr(m, SCALES) if m.weight.dtype == fp8_ops.FP8 else None


def fusable(linears: list[nn.Module]) -> bool:
    """Whether projections can be row-concatenated: all plain, or all FP8 with whole 128-row blocks each (the
    fused scales are the parts' scale rows, stacked)."""
    fp8 = [m.weight.dtype == fp8_ops.FP8 for m in linears]
    if not any(fp8):
        return True
    return all(fp8) and all(m.weight.shape[0] % fp8_ops.BLOCK == 0 for m in linears)


def run(
    x, weight, s, bias, mode: str, tune: bool, gate=None, act: int = 1, in_parts: bool = False, dtype=None
):
    """x [..., K] (or one row's fp32 partial sums [S, 1, K], `in_parts`, with the activations' `dtype`) through
    an FP8 weight [N, K] and its scales `s`: [..., N] ([1, N] from partial sums). With `gate` the input is
    act(gate) * x (`gemv.ACTS`)."""
    if mode == "torch":
        if in_parts:  # the row the partial sums make, rounded as a GEMV's output is
            x, gate = (None if y is None else y.sum(0).to(dtype) for y in (x, gate))
        return fp8_ops.reference(x, weight, s, bias, gate, act)
    return fp8_ops.linear(x, weight, s, bias, gate, act, in_parts, dtype, mode == "w8a8", tune)


def run_parts(
    x, weight, s, mode: str, tune: bool, gate=None, act: int = 1, in_parts: bool = False, dtype=None
):
    """`run` for up to `fp8_ops.ROWS` rows, as the FP8 kernel's fp32 partial sums [slices, rows, N]
    (`ops.fp8.linear_parts`); None in the torch mode (no partial sums there)."""
    if mode == "torch":
        return None
    return fp8_ops.linear_parts(x, weight, s, gate, act, in_parts, dtype, mode == "w8a8", tune)
