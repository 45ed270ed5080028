"""Projections of the static engine: fused q/k/v and gate/up weights, few-row GEMVs, and their partial sums.

- `FusedLinear`: row-concatenated projections run as one GEMM (`FastOptions.fuse`); the modules' own weights
  become views into the fused tensor, so memory does not grow and HF's forward still works.
- `Gemv`: whether few-row projections go through `ops.gemv` (its split-K kernels or cuBLAS, as timed faster),
  for how many rows, and whether the kernels' configs are timed (`FastOptions.gemv`, `gemv_rows`, `tune`).
- `Parts`: a one-row GEMV's output left as its fp32 partial sums, which the next residual add sums in its own
  kernel (`Norms.add`, the sandwich kernel), so no kernel of its own adds them up; an FP8 projection's too for
  up to `fp8_ops.ROWS` rows (a verify or draft block: its tensor-core kernel splits K over the SMs as well).
Projections with FP8 weights (fp8.py) run through the FP8 ops wherever they appear (`project` always takes
them, whatever the row count); q/k/v and gate/up fuse, scales too, where each part fills whole 128-row blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from dflash_zoo.cuda.ops import fp8 as fp8_ops
from dflash_zoo.cuda.ops import gemv as gemv_ops
from dflash_zoo.cuda.static import fp8


@dataclass(frozen=True)
class Gemv:
    """Few-row projections through `gemv_ops.gemv`: `on`, for steps of at most `rows` rows (at most
    `gemv_ops.ROWS`), with the configs timed per shape where `tune`; FP8 projections as `fp8` says (one of
    `engine.options.FP8`)."""

    on: bool = False
    rows: int = 1
    tune: bool = True
    fp8: str = "torch"

    def takes(self, x: torch.Tensor) -> bool:
        """Whether rows x [..., in] go through the GEMV kernels."""
        return self.on and _rows(x) <= min(self.rows, gemv_ops.ROWS)


OFF = Gemv()


def _rows(x: torch.Tensor) -> int:
    """Rows of x [..., in]: all leading sizes together."""
    return x.numel() // x.shape[-1]


def _back_to_back(parts: list[torch.Tensor]) -> bool:
    """Whether `parts` already lie contiguously, in order, in one storage (an earlier fuse): a view covers them."""
    ptr, offset = parts[0].untyped_storage().data_ptr(), parts[0].storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != ptr or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


def _fuse_param(linears: list[nn.Linear], name: str) -> torch.Tensor | None:
    parts = [getattr(m, name, None) for m in linears]  # name: "weight" or "bias"
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError(f"cannot fuse projections of which only some have a {name}")
    rows = sum(p.shape[0] for p in parts)
    if _back_to_back(parts):  # fused by an earlier engine: view, do not copy again
        return parts[0].detach().as_strided((rows, *parts[0].shape[1:]), parts[0].stride())
    fused = torch.cat([p.detach() for p in parts])  # [sum(out), in] or [sum(out)]
    start = 0
    for m, p in zip(linears, parts, strict=True):
        # Parameter reassignment, not a patch: same module, same name, its data now a row view of `fused`;
        # the old storage is freed, so the fused copy costs no memory and the HF forward still works.
        setattr(m, name, nn.Parameter(fused[start : start + p.shape[0]], requires_grad=p.requires_grad))
        start += p.shape[0]
    return fused


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: Gemv,
           scales: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [..., in] @ weight [out, in]^T + bias: for few rows through `gemv_ops.gemv` where `gemv` takes them,
    else cuBLAS; an FP8 weight (with its block `scales`) through the FP8 ops, any rows."""
    if scales is not None:
        return fp8.run(x, weight, scales, bias, gemv.fp8, gemv.tune)
    if gemv.takes(x):
        return gemv_ops.gemv(x, weight, bias, None, tune=gemv.tune)
    return F.linear(x, weight, bias)


class FusedLinear:
    """Row-concatenated projections (q/k/v or gate/up) run as one GEMM and split back into their outputs.

    With `fuse=False` the modules run one by one (the unfused baseline). Built under `no_grad` and outside
    inference mode, so the modules stay trainable (gradients reach each view Parameter).
    """

    def __init__(self, linears: list[nn.Module], fuse: bool = True, gemv: Gemv = OFF):
        self.sizes = [m.weight.shape[0] for m in linears]  # linears, or a router module with a [E, H] weight
        fuse = fuse and fp8.fusable(linears)  # FP8 parts: each in whole 128-row blocks, else one by one
        self.linears = None if fuse else linears
        # few rows through `gemv_ops.gemv` (its kernels or cuBLAS); FP8 parts as `gemv.fp8`, fused or not
        self.gemv = gemv if fuse else replace(OFF, fp8=gemv.fp8, tune=gemv.tune)
        self.weight = self.bias = self.scales = None
        if fuse:
            with torch.inference_mode(False), torch.no_grad():
                self.weight, self.bias = _fuse_param(linears, "weight"), _fuse_param(linears, "bias")
                if fp8.scales(linears[0]) is not None:  # [sum(out) / 128, in / 128]
                    self.scales = _fuse_param(linears, fp8.SCALES)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> one [..., out_j] per projection (views into one GEMM output when fused)."""
        if self.linears is not None:
            return tuple(apply(m, x, self.gemv) for m in self.linears)
        return self.joint(x).split(self.sizes, dim=-1)

    def parts(self, x: torch.Tensor, block: bool = False) -> torch.Tensor | None:
        """One row x [..., in] -> the fp32 partial sums [splits, 1, sum(out_j)] of the fused GEMV (`gemv_parts`),
        for a kernel that sums them as it reads them; with `block` (a reader that takes several rows) an FP8
        weight's [splits, rows, sum(out_j)] for up to `fp8_ops.ROWS` rows too. None where that does not apply
        (unfused, a bias, GEMV off, more rows, or traced: the slice count is tuned at run time)."""
        most = fp8_ops.ROWS if block and self.scales is not None else 1
        if self.linears is not None or self.bias is not None or not self.gemv.on or _rows(x) > most:
            return None
        if torch.compiler.is_compiling():
            return None
        if self.scales is not None:  # None in fp8's torch mode
            return fp8.run_parts(x, self.weight, self.scales, self.gemv.fp8, self.gemv.tune)
        return gemv_ops.gemv_parts(x, self.weight, None, tune=self.gemv.tune)

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., sum(out_j)]: the outputs side by side (one GEMM when fused)."""
        if self.linears is not None:
            return torch.cat([apply(m, x, self.gemv) for m in self.linears], dim=-1)
        return linear(x, self.weight, self.bias, self.gemv, self.scales)


@dataclass(frozen=True)
class Parts:
    """A few-row GEMV's output as its fp32 partial sums [splits, rows, N] (`gemv_ops.gemv_parts`), plus its bias:
    the residual add sums them in its own kernel (`Norms.add`), so no kernel of its own adds them up."""

    sums: torch.Tensor
    bias: torch.Tensor | None
    more: torch.Tensor | None = None  # a second output's partial sums, added to the first (a shared expert's)

    def total(self, like: torch.Tensor) -> torch.Tensor:
        """The GEMV's output, shaped and typed like `like` (where no fused add takes the sums)."""
        y = self.sums.sum(0)
        for extra in (self.more.sum(0) if self.more is not None else None, self.bias):
            y = y if extra is None else y + extra.float()
        return y.to(like.dtype).view(like.shape)


def summed(out: torch.Tensor | Parts, like: torch.Tensor) -> torch.Tensor:
    """`out` as a tensor (`Parts` summed, shaped and typed like `like`)."""
    return out.total(like) if isinstance(out, Parts) else out


def plus(x: torch.Tensor, delta: torch.Tensor | Parts | None) -> torch.Tensor:
    """x + delta, as separate ops (where no fused add takes it)."""
    return x if delta is None else x + summed(delta, x)


def apply(m: nn.Linear, x: torch.Tensor, gemv: Gemv) -> torch.Tensor:
    """m(x): the module itself, or for an FP8 weight the FP8 op (`gemv.fp8`)."""
    s = fp8.scales(m)
    return m(x) if s is None else fp8.run(x, m.weight, s, m.bias, gemv.fp8, gemv.tune)


def project(m: nn.Linear, x, gate: torch.Tensor | None, gemv: Gemv, fold: bool, act: int = 1):
    """m(x), or m(act(gate) * x) with `gate` (`act` of `gemv_ops.ACTS`), for a few rows through `gemv_ops.gemv`:
    for one row as `Parts` with `fold` (the next residual add sums them). None where the kernels do not apply
    (off, or too many rows); an FP8 weight always runs here (through the FP8 ops, any rows), as `Parts` with
    `fold` for up to `fp8_ops.ROWS` rows (the block kernel's slices: no kernel of their own adds them up)."""
    s = fp8.scales(m)
    if s is not None:
        # partial sums' slice count is tuned at run time: not traceable
        few = fold and _rows(x) <= fp8_ops.ROWS and not torch.compiler.is_compiling()
        sums = fp8.run_parts(x, m.weight, s, gemv.fp8, gemv.tune, gate, act) if few else None
        if sums is not None:
            return Parts(sums, m.bias)
        return fp8.run(x, m.weight, s, m.bias, gemv.fp8, gemv.tune, gate, act)
    if not gemv.takes(x):
        return None
    # gemv_parts' shape is tuned at run time: not traceable
    if fold and _rows(x) == 1 and not torch.compiler.is_compiling():
        return Parts(gemv_ops.gemv_parts(x, m.weight, gate, act=act, tune=gemv.tune), m.bias)
    return gemv_ops.gemv(x, m.weight, m.bias, gate, act, tune=gemv.tune)


def project_sums(m: nn.Linear, up, gate, act: int, gemv: Gemv, fold: bool, dtype: torch.dtype):
    """m(act(gate) * up) of one row whose gate and up are a GEMV's fp32 partial sums [S, 1, F] (the kernel sums
    them as it reads them), in `dtype`: as `Parts` with `fold`, else [1, N]."""
    s, tune = fp8.scales(m), gemv.tune
    if s is None:
        if fold:
            return Parts(gemv_ops.gemv_parts(up, m.weight, gate, act=act, in_parts=True, tune=tune), m.bias)
        return gemv_ops.gemv(up, m.weight, m.bias, gate, act, True, tune)
    sums = fp8.run_parts(up, m.weight, s, gemv.fp8, tune, gate, act, True, dtype) if fold else None
    if sums is not None:
        return Parts(sums, m.bias)
    return fp8.run(up, m.weight, s, m.bias, gemv.fp8, tune, gate, act, True, dtype)
