"""FP8 projections: y = x @ dequant(W, S)^T + b, for weights in transformers' fine-grained FP8 layout.

The layout (transformers `integrations/finegrained_fp8.py`, `FP8Linear`; DeepSeek-V3's, Qwen3-FP8's): W is
float8_e4m3fn [N, K]; S (`weight_scale_inv`) holds one fp32 scale per 128 x 128 block [ceil(N/128),
ceil(K/128)], the block's absolute maximum / 448 (e4m3's largest finite value), and dequant(W, S) = W * S in
fp32 (fp8_format.py: `quantize`, `dequantize`, re-exported here); `reference` is the torch form the kernels are
tested against.

`linear` reads the FP8 weight itself (half a bf16 weight's bytes, the whole point: decoding is memory-bound):
- one row: gemv.py's split-K GEMV (`BLOCKS`), each input column times its block's scale, its products summed
  per row each iteration or at the end (`GEMV_CONFIGS` modes); `linear_parts` stops before the sum (the next
  residual add sums the slices); `in_parts` takes a gate/up GEMV's sums as input;
- more rows (a verify or draft block, a prefill; a gated input multiplied out first, `_gated`): a tensor-core
  kernel multiplying x by the e4m3 tile (exact in 16 bits; for bf16 on CUDA converted with bit operations,
  `fp8_kernels.e4m3_bf16`, rather than conversion instructions), each block's product scaled as it is added:
  weight-only, exact up to the sums' rounding.
  `w8a8` quantizes the rows per 128 columns instead (amax / 448, as transformers' FP8 kernel does) and
  multiplies on Hopper's FP8 tensor cores: not exact, an option (`FastOptions.fp8`).
Configs are timed per shape on CUDA (`runtime.graph_ms`, outside graph capture), else the first is taken.
Torch custom ops (one opaque call to `torch.compile`, captured by CUDA graphs), run on a CUDA GPU of compute
capability >= 9.0 (`device_reason`) or anywhere under Triton's interpreter (the CPU tests).
"""

from __future__ import annotations

import functools
import logging

import torch

from dflash_zoo.cuda.ops import fused
from dflash_zoo.cuda.ops.fp8_format import (  # noqa: F401  (the format, re-exported)
    BLOCK,
    FP8,
    QMAX,
    blocks,
    dequantize,
    layout_reason,
    quantize,
    quantize_rows,
)
from dflash_zoo.cuda.ops.gemv import ACT_OPS
from dflash_zoo.cuda.ops.runtime import available, graph_ms, launch_mode, pow2, split_k, tunes

log = logging.getLogger("dflash_zoo")

CAPABILITY = (9, 0)  # Hopper: where the kernels were built for (and FP8 tensor cores exist)
ROWS = 16  # up to this many rows a step's projections split K over the SMs; more rows (prefill) tile M
# the tensor-core kernel converts e4m3 to bf16 with bit operations (`fp8_kernels.e4m3_bf16`) where the GPU test
# `test_bf16_tensor_core_kernel_reads_every_e4m3_value_exactly` has passed (one H100, torch 2.11, triton 3.6);
# False: Triton's cast
BITS_CUDA_VERIFIED = True

# one row: (rows per program, K per iteration, programs per SM, warps, mode); BN divides BLOCK (a tile's rows
# share one row of scale blocks), BK divides it or spans blocks (each column loads its scale); mode: 0 plain, 1
# the next tile's load in flight (PREFETCH), 2 row sums each iteration (ROW_SUMS: the fastest on most of an 8B
# shape's projections, one H100, docs/performance.md). The first of each list runs untimed (`tune` off: the GPU
# tests; the CPU tests, whose interpreter is fastest on big tiles)
PREFETCH, ROW_SUMS = 1, 2
GEMV_CONFIGS = [
    (bn, bk, per_sm, 4 if bn * bk <= 4096 else 8, mode)
    for mode in (PREFETCH, 0)
    for bn in (64, 32, 16)
    for bk in (128, 256, 64)
    for per_sm in (4, 8, 2)
] + [(bn, bk, per_sm, 8, ROW_SUMS) for bn in (64, 32) for bk in (256, 512) for per_sm in (4, 8, 2)]
# one program reading a row's fp32 partial sums: the residual add took 2.1 us more per call for 12 more slices
# of 4,096 (an 8B shape's o_proj, one H100, docs/performance.md); the one-row tuner adds this cost per slice
SUMMING_BYTES_PER_S = 90e9
# 2..ROWS rows: (BM, BN, BK, programs per SM, warps, stages); per_sm 1 at wide N gives few K slices, one at
# N / BN >= the SMs, written directly (no partial sums, no second kernel). BN 32 (more programs, thinner tiles)
# won some of an 8B shape's verify-block projections on one H100; tiles of 64 rows (Hopper's wgmma, 16 rows
# padded) and 8 warps never won there, so are not offered (docs/performance.md)
GEMM_CONFIGS = [
    (16, bn, 128, per_sm, 4, stages) for bn in (128, 64) for per_sm in (1, 2, 4) for stages in (3, 2, 4)
] + [(16, 32, 128, per_sm, 4, stages) for per_sm in (2, 4) for stages in (3, 4)]
# more rows (a prefill): one K slice
PREFILL_CONFIGS = [(64, 128, 128, 0, 4, 3), (128, 128, 128, 0, 8, 3), (64, 64, 128, 0, 4, 4)]
_tuned: dict[tuple, tuple[int, ...]] = {}


@functools.cache
def _kernels():
    from dflash_zoo.cuda.ops import fp8_kernels as k  # triton on first use only
    from dflash_zoo.cuda.ops import gemv_kernels as g

    return g.gemv_part, k.fp8_gemm, g.gemv_sum, g.TL_DTYPES


def device_reason(device: torch.device, capability: tuple[int, int] | None = None) -> str | None:
    """None where the FP8 kernels run on `device` (a CUDA GPU of compute capability >= 9.0 with triton, or
    Triton's interpreter), else why not. `capability`: the GPU's (None: asked of the device)."""
    why = available(device)
    if why is not None or device.type != "cuda":
        return why
    have = capability or torch.cuda.get_device_capability(device)
    if tuple(have) < CAPABILITY:
        return f"the FP8 kernels need a Hopper GPU (compute capability >= 9.0), not {have[0]}.{have[1]}"
    return None


# ---- the torch reference ----------------------------------------------------------------------------------
def reference(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
    gate: torch.Tensor | None = None, act: int = 1, w8a8: bool = False, dtype: torch.dtype | None = None,
) -> torch.Tensor:  # fmt: skip
    """`linear` in torch: dequantize, then multiply in fp32, rounded to `dtype` (x's). With `gate`, the input is
    act(gate) * x as HF computes it; `w8a8`: x quantized per row and 128 columns first (`quantize_rows`)."""
    dtype = dtype or x.dtype
    if gate is not None:
        x = ACT_OPS[act](gate.to(dtype)) * x.to(dtype)
    xf = x.float()
    if w8a8:
        q, xs = quantize_rows(xf)
        xf = q.float() * xs.repeat_interleave(BLOCK, -1)[..., : x.shape[-1]]
    y = xf @ dequantize(weight, scales).T
    return (y if bias is None else y + bias.float()).to(dtype)


# ---- launches -----------------------------------------------------------------------------------------------
W8A8, W8A8_SWAP = 1, 2  # a 2+ row config's last entry: quantized activations, the weight tile on the left


def w8a8_of(config: tuple) -> bool:
    """Whether a config of 2+ rows multiplies quantized activations (the flag rides in it: `_configs`)."""
    return len(config) > 6 and bool(config[6])


def _parts(x, weight, scales, gate, config, act: int, in_parts: bool, dtype, bias=None, direct=False):
    """fp32 partial sums [slices, rows, N] of x [..., K] (or one row's partial sums [S, 1, K], `in_parts`)
    times dequant(weight)^T; with `direct` and one slice (2+ rows), the output [rows, N] itself."""
    act = act if gate is not None else 0
    g = gate if gate is not None else x
    if in_parts or x.numel() == x.shape[-1]:
        return _gemv_parts(x, weight, scales, g, config, act, in_parts, dtype)
    return _gemm(x, weight, scales, g, config, act, dtype, bias, direct)


def _gemv_parts(x, weight, scales, g, config, act: int, in_parts: bool, dtype) -> torch.Tensor:
    """One row: the split-K GEMV's fp32 partial sums [slices, 1, N]."""
    (n, k), (bn, bk, per_sm, warps, mode) = weight.shape, config
    out_blocks, splits, k_split = split_k(n, k, bn, bk, per_sm, x)
    part = torch.empty(splits, 1, n, device=x.device, dtype=torch.float32)
    in_splits, in_plane = (x.shape[0], x.stride(0)) if in_parts else (1, 0)
    _kernels()[0][(out_blocks, splits)](
        weight, scales, x, g, x, part, n, k, k_split, scales.stride(0), in_splits, in_plane, DT=_kernels()[3][dtype],
        BN=bn, BK=bk, ACT=act, SCALE=False, BLOCKS=True, PREFETCH=mode == PREFETCH, IN_PARTS=in_parts,
        ROW_SUMS=mode == ROW_SUMS, num_warps=warps, **launch_mode(x),
    )  # fmt: skip
    return part


def _gemm(x, weight, scales, g, config, act: int, dtype, bias, direct: bool) -> torch.Tensor:
    """2+ rows on the tensor cores: fp32 partial sums [slices, rows, N], or with `direct` and one slice the
    output [rows, N] (plus bias) in x's dtype. A prefill config (per_sm 0) tiles M and takes K whole. A gated
    input is multiplied out first (`_gated`)."""
    (n, k), (bm, bn, bk, per_sm, warps, stages) = weight.shape, config[:6]
    rows = x.numel() // k
    x2 = x.reshape(rows, k)  # a view: rows may be strided (halves of gate/up)
    if act:
        x2 = _gated(g.reshape(rows, k), x2, act, dtype)
    if per_sm:
        out_blocks, splits, k_split = split_k(n, k, bn, bk, per_sm, x)
    else:
        out_blocks, splits, k_split = -(-n // bn), 1, bk * -(-k // bk)
    direct = direct and splits == 1
    shape = (rows, n) if direct else (splits, rows, n)
    out = torch.empty(shape, device=x.device, dtype=dtype if direct else torch.float32)
    _kernels()[1][(-(-rows // bm), out_blocks, splits)](
        weight, scales, x2, out, bias if bias is not None else out, rows, n, k, k_split, x2.stride(0),
        scales.stride(0), BM=bm, BN=bn, BK=bk, DIRECT=direct, BIAS=bias is not None, IEEE=dtype == torch.float32,
        W8A8=w8a8_of(config), SWAP=w8a8_of(config) and config[6] == W8A8_SWAP,
        BITS=BITS_CUDA_VERIFIED and x.is_cuda and dtype == torch.bfloat16, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _gated(gate: torch.Tensor, x: torch.Tensor, act: int, dtype: torch.dtype) -> torch.Tensor:
    """act(gate) * x [rows, K] in `dtype`, each op rounded as HF's, once for all output tiles (computed in the
    kernel, every tile of N recomputes it: an 8B shape's 16-row down projection took 35.6 us so, 25.3 us
    after a separate product, which took 1.6 us in a step; one H100, docs/performance.md)."""
    if act == 1 and gate.dtype == x.dtype == dtype:
        return fused.silu_mul(gate, x)  # one kernel
    return ACT_OPS[act](gate.to(dtype)) * x.to(dtype)


def _launch(x, weight, scales, bias, gate, config, act: int, in_parts: bool, dtype) -> torch.Tensor:
    """`linear` with a given config: the kernel's output, or its partial sums added up (bias too) by
    gemv.py's sum kernel."""
    n = weight.shape[0]
    shape = (1, n) if in_parts else (*x.shape[:-1], n)
    part = _parts(x, weight, scales, gate, config, act, in_parts, dtype, bias, direct=True)
    if part.dim() == 2:  # one K slice of 2+ rows: the kernel wrote the output
        return part.view(shape)
    splits, flat = part.shape[0], part[0].numel()
    out = torch.empty(shape, device=x.device, dtype=dtype)
    b = bias if bias is not None else part
    _kernels()[2][(-(-flat // 256),)](
        part, b, out, flat, splits, n, BLOCK=256, S=pow2(splits, 1), BIAS=bias is not None, **launch_mode(x)
    )  # fmt: skip
    return out


def _configs(rows: int, w8a8: bool) -> list[tuple]:
    """The candidates for a row count; w8a8's carry the flag. Hopper's FP8 wgmma takes 64 rows or more on its
    left (fewer, Triton multiplies FP8 as fp16 on sm_90): a prefill's w8a8 tiles put 64+ rows of x there; up
    to ROWS rows the weight's 64 or 128 rows go there and x's rows unpadded on the right (W8A8_SWAP; 16 rows
    padded to 64 took 5.9x as long a step, one H100, docs/performance.md)."""
    if rows == 1:
        return GEMV_CONFIGS
    if not w8a8:
        return GEMM_CONFIGS if rows <= ROWS else PREFILL_CONFIGS
    if rows <= ROWS:
        return [(*c, W8A8_SWAP) for c in GEMM_CONFIGS if c[1] >= 64]
    return [(max(c[0], 64), *c[1:], W8A8) for c in PREFILL_CONFIGS]


def _summing_ms(x, weight, config, rows: int) -> float:
    """What a row's partial sums cost the kernel that reads them, for the tuner: the slices read as the
    residual add reads them (`fused.add_rms_norm`, one program per row, the rows side by side), at about
    SUMMING_BYTES_PER_S. Charged to every partial-sums tuning: the tuner does not know the reader (rope or the
    next GEMV read them over many programs, so there it overstates the cost)."""
    n, k = weight.shape
    bn, bk, per_sm = config[:3] if rows == 1 else config[1:4]
    splits = split_k(n, k, bn, bk, per_sm, x)[1] if per_sm else 1
    return splits * n * 4 / SUMMING_BYTES_PER_S * 1e3


def _config(x, weight, scales, gate, act, in_parts, dtype, w8a8, tune, parts=False) -> tuple:
    """The fastest config for this shape and row count (rows > ROWS share one), timed once where
    `runtime.tunes` (each call after a 128 MB write, so the weight comes from HBM), else the first."""
    rows = 1 if in_parts else x.numel() // x.shape[-1]
    w8a8 = w8a8 and rows > 1
    configs = _configs(rows, w8a8)
    key = (tuple(weight.shape), act if gate is not None else 0, min(rows, ROWS + 1), in_parts, parts, w8a8,
           dtype, x.device)  # fmt: skip
    if key in _tuned:
        return _tuned[key]
    if not tunes(x, tune):
        return configs[0]
    flush = torch.empty(2**25, device=x.device, dtype=torch.float32)
    base = graph_ms(flush.zero_)
    if parts:
        run = functools.partial(_parts, act=act, in_parts=in_parts, dtype=dtype)
    else:
        run = functools.partial(_launch, bias=None, act=act, in_parts=in_parts, dtype=dtype)
    times = {
        c: graph_ms(lambda c=c: (flush.zero_(), run(x, weight, scales, gate=gate, config=c)))
        - base
        + (_summing_ms(x, weight, c, rows) if parts else 0.0)
        for c in configs
    }
    _tuned[key] = best = min(times, key=times.get)
    log.debug("fp8 %s: %s (%.1f us)", key[:6], best, times[best] * 1e3)
    return best


def tuned_configs() -> dict[str, list[int]]:
    """The configs timed so far, by rows, K and N ("1x12288->4096+gated"), for bench records."""
    return {
        f"{'>16' if rows > ROWS else rows}x{k}->{n}{'+gated' if act else ''}{'+in_parts' if inp else ''}"
        f"{'+parts' if parts else ''}{'+w8a8' if w8a8 else ''}": list(c)
        for ((n, k), act, rows, inp, parts, w8a8, _, _), c in _tuned.items()
    }


def _inputs(x, weight, scales, gate, in_parts: bool, dtype, rows_cap: int | None):
    """Checked inputs: FP8 weight and fp32 scales of the block grid, a row-contiguous x (and gate), the dtype."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise ValueError(f"an FP8 projection takes a float8_e4m3fn [N, K] weight, not {weight.dtype}")
    n, k = weight.shape
    if scales.dtype != torch.float32 or tuple(scales.shape) != (blocks(n), blocks(k)):
        raise ValueError(
            f"block scales of a [{n}, {k}] weight are fp32 [{blocks(n)}, {blocks(k)}], "
            f"not {scales.dtype} {list(scales.shape)}"
        )
    if in_parts:
        if x.dim() != 3 or x.shape[1] != 1 or x.dtype != torch.float32 or dtype is None:
            raise ValueError("partial sums as input: fp32 [slices, 1, K] rows, and the activations' dtype")
        if gate is not None and (gate.shape != x.shape or gate.stride() != x.stride()):
            raise ValueError("the gate's partial sums are laid out as the input's")
        return x, gate, dtype
    rows = x.numel() // x.shape[-1]
    if rows_cap is not None and rows > rows_cap:
        raise ValueError(f"FP8 partial sums take at most {rows_cap} rows, not {list(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()  # rows may stay strided; each row contiguous
    gate = gate if gate is None or gate.stride(-1) == 1 else gate.contiguous()
    return x, gate, dtype or x.dtype


@torch.library.custom_op("dflash_zoo::fp8_linear", mutates_args=())
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    gate: torch.Tensor | None = None,
    act: int = 1,
    in_parts: bool = False,
    dtype: torch.dtype | None = None,
    w8a8: bool = False,
    tune: bool = True,
) -> torch.Tensor:
    """x [..., K] -> x @ dequant(weight, scales)^T (+ bias) [..., N], in `dtype` (x's). With `gate` the input is
    act(gate) * x (`gemv.ACTS`). One row: the split-K GEMV; more: the tensor-core kernel (`w8a8`: activations
    quantized, FP8 tensor cores). `in_parts`: x and gate are one row's fp32 partial sums [S, 1, K]; `dtype`
    then names the activations' dtype; the output is [1, N]. `tune`: time the configs, else the first."""
    x, gate, dtype = _inputs(x, weight, scales, gate, in_parts, dtype, None)
    config = _config(x, weight, scales, gate, act, in_parts, dtype, w8a8, tune)
    return _launch(x, weight, scales, bias, gate, config, act, in_parts, dtype)


@linear.register_fake
def _(x, weight, scales, bias, gate=None, act=1, in_parts=False, dtype=None, w8a8=False, tune=True):
    shape = (1, weight.shape[0]) if in_parts else (*x.shape[:-1], weight.shape[0])
    return x.new_empty(shape, dtype=dtype or x.dtype)


@torch.library.custom_op("dflash_zoo::fp8_linear_parts", mutates_args=())
def linear_parts(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    gate: torch.Tensor | None = None,
    act: int = 1,
    in_parts: bool = False,
    dtype: torch.dtype | None = None,
    w8a8: bool = False,
    tune: bool = True,
) -> torch.Tensor:
    """`linear` without its last kernel, for at most ROWS rows: fp32 partial sums [slices, rows, N] whose
    in-order sum is the output before bias and rounding (`fused.add_rms_norm` sums them into the residual,
    `fused.rope_store` into q/k/v)."""
    x, gate, dtype = _inputs(x, weight, scales, gate, in_parts, dtype, ROWS)
    config = _config(x, weight, scales, gate, act, in_parts, dtype, w8a8, tune, parts=True)
    return _parts(x, weight, scales, gate, config, act, in_parts, dtype)


@linear_parts.register_fake
def _(x, weight, scales, gate=None, act=1, in_parts=False, dtype=None, w8a8=False, tune=True):
    # not traceable: the slice count is tuned at run time (the static path never compiles it)
    raise NotImplementedError("fp8_linear_parts has no fixed output shape to trace")
