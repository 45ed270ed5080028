"""Triton kernels for the static path's few-row projections: a split-K GEMV, timed against cuBLAS.

`gemv`: y = W x for one row, split over K as well as over output rows. At batch 1 a [4096, 12288] down
projection has only 4,096 rows to spread over the SMs; inductor's fused SiLU + GEMV reached 2.9 TB/s on it and
cuBLAS 3.35, against 4.3 for the wide gate/up (on an H200, docs/performance.md). Each program reduces a
[rows x K-slice] tile; a second kernel adds the slices (fixed order: deterministic). With `gate` the input is
HF's `act_fn(gate) * up` for SiLU or GELU's tanh form (`ACTS`), computed in the kernel with torch's rounding
(the activation, then the product, each rounded to the dtype).
The tile configuration is timed once per shape on CUDA (`_gemv_config`), outside graph capture, against cuBLAS
too where a plain output is wanted (the faster runs). `gemv_parts` stops before the sum: the next residual add
sums the slices (`fused.add_rms_norm`). 2..16 rows run a tensor-core variant of the same split
(`gemm_part`), used by the static path only when `FastOptions.gemv_rows` asks (`DFLASH_ZOO_GEMV_ROWS`; in a
16-row step it gave no clear gain over cuBLAS, docs/performance.md). `tune` (`FastOptions.tune`) off: each
kernel's first config, untimed.

Torch custom ops, so `torch.compile` sees one opaque call and CUDA graphs capture the launches. They run on
CUDA, or anywhere under Triton's interpreter (`TRITON_INTERPRET=1`, CPU tests). Triton is imported on first use.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from dflash_zoo.cuda.ops.runtime import graph_ms, launch_mode, pow2, split_k, tunes

log = logging.getLogger("dflash_zoo")


# a gated input's activation, as the kernels' ACT: 1 SiLU, 3 GELU's tanh form (moe.GATES adds 2, gpt-oss's
# clamped form, for the expert kernels), with the torch op each stands for (cuBLAS runs it first) and its name
# in `tuned_configs`
ACTS = {"silu": 1, "gelu_tanh": 3}
ACT_OPS = {0: lambda g: g, 1: F.silu, 3: lambda g: F.gelu(g, approximate="tanh")}
ACT_NAMES = {0: "", 1: "+silu", 3: "+gelu"}


@functools.cache
def _kernels():
    from dflash_zoo.cuda.ops import gemv_kernels as k  # triton on first use only

    return k.gemv_part, k.gemv_sum, k.gemm_part, k.TL_DTYPES


# (rows per program, K per iteration, programs per SM, warps, prefetch): the candidates `_gemv_config` times per
# shape; prefetch 1 keeps the next weight tile's load in flight while the current one is multiplied
GEMV_CONFIGS = [
    (bn, bk, per_sm, 4 if bn * bk <= 4096 else 8, prefetch)
    for prefetch in (0, 1)
    for bn in (8, 16, 32)
    for bk in (128, 256)
    for per_sm in (4, 8, 2)
]
ROWS = 16  # the most rows `gemv` takes to its own kernels


# few rows (2..ROWS): (output columns per program, K per iteration, programs per SM, warps, pipeline stages);
# per_sm 1 at wide N gives one K slice, whose program writes the output itself (no partial sums, no second
# kernel). Two or three stages: at 16 rows the best of them beat cuBLAS on the 8B shapes' q/k/v, o and down
# (on an H200, docs/performance.md)
GEMM_CONFIGS = [
    (bn, bk, per_sm, 4, stages)
    for bn in (64, 128)
    for bk in (64, 128)
    for per_sm in (1, 2, 4)
    for stages in (2, 3)
]
CUBLAS = (
    None  # the config that runs `F.linear` instead: timed beside the kernel's where a plain output is wanted
)
# Qwen3-8B's gate/up timed 2% faster alone on cuBLAS, yet a step ran 208.0 tok/s with it and 214.5 with the
# GEMV (one H200, docs/performance.md): cuBLAS must win by this fraction to be chosen
CUBLAS_MARGIN = 0.05
_tuned: dict[tuple, tuple[int, ...] | None] = {}


def _gemv_parts(x, weight, gate, config, bias=None, direct: bool = False, scale=None, act: int = 1,
                in_parts: bool = False) -> torch.Tensor:  # fmt: skip
    """fp32 partial sums [splits, rows, N] of x [..., K] (rows = all leading sizes, at most ROWS) times weight
    [N, K]^T over slices of K; with `direct` and one slice, the output [rows, N] itself (bias added). `scale`
    (one row only): a logit whose sigmoid multiplies the sums. With `gate`, the input is act(gate) * x (`ACTS`).
    `in_parts`: x (and gate) are one row's fp32 partial sums [S, 1, K] (`_in_parts`)."""
    act = act if gate is not None else 0
    n, k = weight.shape
    rows = 1 if in_parts else x.numel() // x.shape[-1]
    bn, bk, per_sm, warps = config[:4]
    blocks, splits, k_split = split_k(n, k, bn, bk, per_sm, x)
    g = gate if gate is not None else x
    if rows == 1:
        part = torch.empty(splits, 1, n, device=x.device, dtype=torch.float32)
        in_splits, in_plane = (x.shape[0], x.stride(0)) if in_parts else (1, 0)
        _kernels()[0][(blocks, splits)](
            weight, x, x, g, scale if scale is not None else x, part, n, k, k_split, 0, in_splits, in_plane,
            DT=_kernels()[3][weight.dtype], BN=bn, BK=bk, ACT=act, SCALE=scale is not None, BLOCKS=False,
            PREFETCH=bool(config[4]), IN_PARTS=in_parts, num_warps=warps, **launch_mode(x),
        )  # fmt: skip
        return part
    if scale is not None:
        raise ValueError(f"a scaled GEMV takes one row, not {rows}")
    x2, g2 = x.reshape(rows, k), g.reshape(rows, k)  # views: rows may be strided (halves of gate/up)
    direct = direct and splits == 1
    part = (
        torch.empty(splits, rows, n, device=x.device, dtype=torch.float32)
        if not direct
        else x.new_empty(rows, n)
    )
    _kernels()[2][(blocks, splits)](
        weight, x2, g2, part, bias if bias is not None else weight, rows, n, k, k_split, x2.stride(0), g2.stride(0),
        R=max(16, pow2(rows)), BN=bn, BK=bk, ACT=act, DIRECT=direct, BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=config[4],
    )  # fmt: skip
    return part


def _gemv_launch(x, weight, bias, gate, config, act: int = 1, in_parts: bool = False) -> torch.Tensor:
    if in_parts:  # the row the partial sums make, as `gemv` would have returned it
        shape = (1, weight.shape[0])
        if config is CUBLAS:
            x, gate = (None if y is None else y.sum(0).to(weight.dtype) for y in (x, gate))
    else:
        shape = (*x.shape[:-1], weight.shape[0])
    if config is CUBLAS:
        return F.linear(x if gate is None else ACT_OPS[act](gate) * x, weight, bias).view(shape)
    part = _gemv_parts(x, weight, gate, config, bias, direct=True, act=act, in_parts=in_parts)
    if part.dtype == x.dtype and part.dim() == 2:  # one K slice: the kernel wrote the output
        return part.view(shape)
    splits, n = part.shape[0], part[0].numel()
    out = torch.empty(shape, device=x.device, dtype=weight.dtype if in_parts else x.dtype)
    b = bias if bias is not None else part
    _kernels()[1][(-(-n // 256),)](
        part, b, out, n, splits, weight.shape[0], BLOCK=256, S=pow2(splits, 1), BIAS=bias is not None,
        **launch_mode(part),
    )  # fmt: skip
    return out


def _gemv_config(
    x, weight, gate, parts: bool = False, act: int = 1, in_parts: bool = False, tune: bool = True
) -> tuple[int, ...] | None:
    """The fastest kernel config for this shape and row count, and cuBLAS too unless `parts` (partial sums
    wanted), timed once where `runtime.tunes` (else the first config).

    Each timed call follows a write of 128 MB (over twice an H200's L2), so that the weight comes from HBM as
    in a real step.
    """
    rows = 1 if in_parts else x.numel() // x.shape[-1]
    configs = GEMV_CONFIGS if rows == 1 else GEMM_CONFIGS
    key = (tuple(weight.shape), weight.dtype, act if gate is not None else 0, parts, rows, x.device, in_parts)
    if key in _tuned:
        return _tuned[key]
    if not tunes(x, tune):
        return configs[0]
    flush = torch.empty(2**25, device=x.device, dtype=torch.float32)
    base = graph_ms(flush.zero_)
    extra = dict(act=act, in_parts=in_parts)
    run = (
        functools.partial(_gemv_parts, **extra)
        if parts
        else functools.partial(_gemv_launch, bias=None, **extra)
    )
    candidates = configs if parts else [*configs, CUBLAS]
    times = {
        c: graph_ms(lambda c=c: (flush.zero_(), run(x, weight, gate=gate, config=c))) - base
        for c in candidates
    }
    if CUBLAS in times:  # cuBLAS only where clearly faster: timed alone it won near-ties that lost in a step
        times[CUBLAS] *= 1 + CUBLAS_MARGIN
    _tuned[key] = best = min(times, key=times.get)
    log.debug("gemv %s: %s (%.1f us)", key[:5], best, times[best] * 1e3)
    return best


def tuned_configs() -> dict[str, list[int] | str]:
    """The configs timed so far, by rows, K and N ("1x12288->4096+silu"), for bench records."""
    return {
        f"{rows}x{k}->{n}{ACT_NAMES[act]}{'+in_parts' if in_parts else ''}{'+parts' if parts else ''}": "cublas"
        if c is CUBLAS
        else list(c)
        for ((n, k), _, act, parts, rows, _, in_parts), c in _tuned.items()
    }


@torch.library.custom_op("dflash_zoo::gemv", mutates_args=())
def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gate: torch.Tensor | None,
    act: int = 1,
    in_parts: bool = False,
    tune: bool = True,
) -> torch.Tensor:
    """A few rows x [..., K] -> x @ weight [N, K]^T (+ bias) [..., N]; with `gate` [..., K], the input is
    act(gate) * x (a gated MLP's down projection; `act` of `ACTS`). One row: the split-K GEMV; 2..ROWS rows: the
    split-K tensor-core kernel; either where it was timed faster than cuBLAS for the shape; more rows: cuBLAS.
    `in_parts`: x and gate are one row's fp32 partial sums [S, 1, K] (`_in_parts`); the output is [1, N].
    `tune`: time the configs (`runtime.tunes`), else take the first."""
    _check_act(act)
    if in_parts:
        _in_parts(x, gate)
        config = _gemv_config(x, weight, gate, act=act, in_parts=True, tune=tune)
        return _gemv_launch(x, weight, bias, gate, config, act, True)
    if x.numel() // x.shape[-1] > ROWS:
        return _gemv_launch(x, weight, bias, gate, CUBLAS, act)
    x, weight, gate = _few_rows(x, weight, gate)
    return _gemv_launch(x, weight, bias, gate, _gemv_config(x, weight, gate, act=act, tune=tune), act)


@gemv.register_fake
def _(x, weight, bias, gate, act=1, in_parts=False, tune=True):
    return weight.new_empty(1, weight.shape[0]) if in_parts else x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("dflash_zoo::gemv_parts", mutates_args=())
def gemv_parts(
    x: torch.Tensor,
    weight: torch.Tensor,
    gate: torch.Tensor | None,
    scale: torch.Tensor | None = None,
    act: int = 1,
    in_parts: bool = False,
    tune: bool = True,
) -> torch.Tensor:
    """`gemv` without its last kernel: fp32 partial sums [splits, rows, N] whose in-order sum is the output
    (before bias and rounding); `fused.add_rms_norm` sums them into the residual. For one row, `scale` (a
    one-element logit) multiplies them by its sigmoid, rounded as torch's: a gated shared expert's output."""
    _check_act(act)
    if in_parts:
        _in_parts(x, gate)
    else:
        x, weight, gate = _few_rows(x, weight, gate)
    config = _gemv_config(x, weight, gate, True, act, in_parts, tune)
    return _gemv_parts(x, weight, gate, config, scale=scale, act=act, in_parts=in_parts)


@gemv_parts.register_fake
def _(x, weight, gate, scale=None, act=1, in_parts=False, tune=True):
    # not traceable: the slice count is tuned at run time (the static path never compiles it)
    raise NotImplementedError("gemv_parts has no fixed output shape to trace")


def _in_parts(x: torch.Tensor, gate: torch.Tensor | None) -> None:
    """Partial sums as an input: one row's fp32 slices [S, 1, K], each row contiguous, gate laid out as x (views
    of one GEMV's [S, 1, 2K] sums, say)."""
    if x.dim() != 3 or x.shape[1] != 1 or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"partial sums as input: fp32 [slices, 1, K] rows, not {x.dtype} {list(x.shape)}")
    if gate is not None and (gate.shape != x.shape or gate.stride() != x.stride()):
        raise ValueError("the gate's partial sums are laid out as the input's")


def _check_act(act: int) -> None:
    if act not in ACT_OPS or not act:
        raise ValueError(f"unknown gate activation {act}: one of {sorted(a for a in ACT_OPS if a)}")


def _few_rows(x, weight, gate):
    if x.numel() // x.shape[-1] > ROWS:
        raise ValueError(f"gemv_parts takes at most {ROWS} rows, not {list(x.shape)}")
    # rows may stay strided (the kernel reads a row stride); each row itself must be contiguous
    if x.stride(-1) != 1:
        x = x.contiguous()
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    return x, weight.contiguous(), gate
