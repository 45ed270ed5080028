"""Which kernels the static engine runs on a device: `FastOptions`' choices, their defaults filled in, checked.

Defaults on CUDA with triton (`FastOptions.kernels`, `DFLASH_ZOO_KERNELS=0` turns them off; explicit choices
stand either way): split-KV attention for every step, one-row projections through the GEMV, the elementwise
work between GEMMs through the fused kernels (uncompiled only: compiled, inductor fuses those ops itself), and
sparse MoE experts through the expert kernels for steps of up to `FastOptions.auto_moe_rows` rows, and an FP8
target's projections through the FP8 kernels (weight-only). Otherwise SDPA (explicit sums over key chunks for a
compiled one-row step), cuBLAS and torch ops (FP8: dequantize, then matmul). Measured on an H200:
docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_zoo.cuda.ops.attention import BLOCK_ATTENTION, DECODE_ATTENTION
from dflash_zoo.cuda.ops.runtime import available
from dflash_zoo.cuda.static.linear import Gemv
from dflash_zoo.engine.options import FastOptions

# without the Triton kernels (no triton), compiled 8B-shape AR step on one H200 host: "chunks" 187 tok/s,
# "sums" 173; SDPA lost to sums (docs/performance.md)
COMPILED_DECODE_ATTENTION = "chunks"


@dataclass(frozen=True)
class Kernels:
    """The resolved choice: attention of one-row steps (`DECODE_ATTENTION`) and of blocks (`BLOCK_ATTENTION`),
    the GEMV for few-row projections, the fused elementwise kernels, the most rows a step may have for the
    expert kernels to run its sparse MoE blocks (0: never), how FP8 projections run (`options.FP8`), and
    whether a step's kernels are launched dependent (`runtime.dependent_launches`; a no-op below Hopper)."""

    decode_attention: str
    block_attention: str
    gemv: bool
    fused_ops: bool
    moe_rows: int
    fp8: str = "torch"
    dependent_launch: bool = False

    def projections(self, options: FastOptions) -> Gemv:
        """How few-row projections run (`linear.Gemv`): the GEMV where chosen, for up to `gemv_rows` rows; FP8
        ones as `fp8`."""
        return Gemv(self.gemv, options.gemv_rows, options.tune, self.fp8)


def choose_kernels(device: torch.device, options: FastOptions) -> Kernels:
    """The kernels for `options` on `device`: defaults filled in, then checked (a choice the device cannot run,
    or an unknown attention, is a `ValueError` naming it)."""
    why = available(device)  # None: the kernels can run here
    triton_ok = options.kernels and device.type == "cuda" and why is None
    decode = options.decode_attention
    if decode is None:
        decode = "split" if triton_ok else COMPILED_DECODE_ATTENTION if options.compile else "sdpa"
    block = options.block_attention or ("split" if triton_ok else "sdpa")
    gemv = triton_ok if options.gemv is None else options.gemv
    # compiled, inductor fuses those ops itself; the kernels were measured uncompiled only
    fused = triton_ok and not options.compile if options.fused_ops is None else options.fused_ops
    for what, name, table in [("decode", decode, DECODE_ATTENTION), ("block", block, BLOCK_ATTENTION)]:
        if name not in table:
            raise ValueError(f"{what}_attention must be one of {sorted(table)}, not {name!r}")
        if name == "split" and why:
            raise ValueError(f"{what}_attention='split': {why}")
    # FP8 projections: the FP8 kernels wherever the Triton kernels are the default (a device's compute
    # capability is engine selection's question, `quantization.fp8_reason`)
    fp8 = options.fp8 or ("weight_only" if triton_ok else "torch")
    for name, on in [("gemv", gemv), ("fused_ops", fused), (f"fp8={fp8!r}", fp8 != "torch")]:
        if on and why:
            raise ValueError(f"{name}: {why}")
    dependent = triton_ok if options.dependent_launch is None else options.dependent_launch
    return Kernels(decode, block, gemv, fused, _moe_rows(why, gemv, options), fp8, dependent)


def _moe_rows(why: str | None, gemv: bool, options: FastOptions) -> int:
    """Steps of at most this many rows run sparse MoE experts through the expert kernels: by default every step
    but the prefill (`auto_moe_rows`, 16) wherever the GEMV kernel runs; an explicit `moe_rows` stands, if the
    kernels can run here."""
    if options.moe_rows is None:
        return options.auto_moe_rows if gemv else 0
    if options.moe_rows and why:
        raise ValueError(f"moe_rows: {why}")
    return options.moe_rows
