"""What a caller asks of the engines, as data: `EngineOptions` (which engine) and `FastOptions` (how the static
engine runs: graphs, compile, fusion, which kernels, tuning).

`FastOptions.from_env()` is the one place that reads the environment variables users set for the fast path
(`ENV`, documented in docs/performance.md); entry points (`load`, `bench`, `eval`) call it once and pass the
options down whole: the engine factory, the static engine, its layers and its ops take them or the fields they
need as arguments. A bench record carries them whole (`to_dict`, read back with `from_dict`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from dflash_zoo.errors import ConfigError

GDN_VERIFY = ("recurrent", "chunk")
FP8 = ("weight_only", "w8a8", "torch")  # how FP8 projections run (cuda/static/fp8.py)
# the environment variables of the fast path and the `FastOptions` field each sets
ENV = {
    "DFLASH_ZOO_KERNELS": "kernels",  # 0: no Triton kernels by default (explicit choices stand)
    "DFLASH_ZOO_TUNE": "tune",  # 0: each kernel's first config, untimed
    "DFLASH_ZOO_MOE_ROWS": "auto_moe_rows",  # steps of up to this many rows run the expert kernels
    "DFLASH_ZOO_GEMV_ROWS": "gemv_rows",  # projections of up to this many rows (max 16) run the GEMV
    "DFLASH_ZOO_GDN_VERIFY": "gdn_verify",  # chunk: Gated-DeltaNet verifies through the chunked rule
    "DFLASH_ZOO_FLA": "fla",  # 0: never flash-linear-attention's kernels
    "DFLASH_ZOO_FP8": "fp8",  # weight_only / w8a8 / torch: how an FP8 target's projections run
    "DFLASH_ZOO_PDL": "dependent_launch",  # 0: each kernel waits for the previous one to end before it starts
}


@dataclass(frozen=True)
class FastOptions:
    """How the static engine runs. None means the engine's default for the device (cuda/static/kernel_choice.py).

    Args:
        graphs: capture each step as a CUDA graph (None: on for CUDA); False runs the same steps eagerly.
        compile: `torch.compile` the step functions (inductor, no dynamic shapes), with `compile_options`
            (None: the engine's, coordinate descent tuning).
        fuse: one GEMM for q/k/v and one for gate/up (the modules' weights become views of the fused tensors).
        fast_norm: RMSNorm through `F.rms_norm` (HF's numerics, fewer kernels).
        decode_attention / block_attention: attention of one-row steps / of verify and draft blocks ("sdpa",
            "split" the Triton kernel; one-row also "sums", "chunks", fast only compiled).
        gemv: few-row projections through the split-K GEMV (timed against cuBLAS per shape).
        fused_ops: the elementwise work between GEMMs through the fused Triton kernels.
        moe_rows: steps of at most this many rows run sparse MoE experts through the expert kernels.
        kernels: the Triton kernels as the default on CUDA (`DFLASH_ZOO_KERNELS`).
        auto_moe_rows: `moe_rows` where it is left to the engine and the GEMV runs (`DFLASH_ZOO_MOE_ROWS`).
        gemv_rows: projections of at most this many rows (1..16) run the GEMV (`DFLASH_ZOO_GEMV_ROWS`).
        gdn_verify: Gated-DeltaNet verify rows through the recurrent kernel or the chunked rule
            (`DFLASH_ZOO_GDN_VERIFY`).
        fla: flash-linear-attention's gated delta rule where installed (`DFLASH_ZOO_FLA`).
        tune: time each kernel's configs per shape on CUDA, else take the first (`DFLASH_ZOO_TUNE`).
        fp8: an FP8 target's projections (`DFLASH_ZOO_FP8`): "weight_only" (the FP8 kernels, weights
            dequantized in registers, 16-bit products: exact up to the sums' rounding), "w8a8" (2+ rows on the
            FP8 tensor cores, activations quantized per 128 columns) or "torch" (dequantize, then matmul: the
            reference). None: weight_only where the Triton kernels run, else torch.
        dependent_launch: a step's Triton kernels launched so that each may start while the previous one
            drains, waiting for it before reading its output (programmatic dependent launch, compute
            capability >= 9.0; `DFLASH_ZOO_PDL`). None: on where the Triton kernels are the default.
    """

    graphs: bool | None = None
    compile: bool = False
    compile_options: Mapping[str, Any] | None = field(default=None, hash=False)
    fuse: bool = True
    fast_norm: bool = True
    decode_attention: str | None = None
    block_attention: str | None = None
    gemv: bool | None = None
    fused_ops: bool | None = None
    moe_rows: int | None = None
    kernels: bool = True
    auto_moe_rows: int = 16
    gemv_rows: int = 1
    gdn_verify: str = "recurrent"
    fla: bool = True
    tune: bool = True
    fp8: str | None = None
    dependent_launch: bool | None = None

    def __post_init__(self) -> None:
        if self.gdn_verify not in GDN_VERIFY:
            raise ConfigError(f"gdn_verify must be one of {', '.join(GDN_VERIFY)}, not {self.gdn_verify!r}")
        if self.fp8 is not None and self.fp8 not in FP8:
            raise ConfigError(f"fp8 must be one of {', '.join(FP8)}, not {self.fp8!r}")
        if not 1 <= self.gemv_rows <= 16:
            raise ConfigError(f"gemv_rows must lie in 1..16, not {self.gemv_rows}")
        for name in ("moe_rows", "auto_moe_rows"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must not be negative, not {value}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **choices: Any) -> FastOptions:
        """The options the environment sets (`ENV`; `environ` defaults to `os.environ`), with `choices` (field
        values) on top. The only place the fast path reads the environment."""
        env = os.environ if environ is None else environ
        read = {field_: _parse(var, env[var]) for var, field_ in ENV.items() if var in env}
        return cls(**{**read, **choices})

    def with_choices(self, **choices: Any) -> FastOptions:
        """A copy with these fields replaced."""
        return replace(self, **choices)

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (for bench records)."""
        out = asdict(self)
        out["compile_options"] = dict(self.compile_options) if self.compile_options is not None else None
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FastOptions:
        """The options `to_dict` wrote (fields this version does not know are left out)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _parse(var: str, text: str) -> Any:
    """An environment variable's value as its field's type (`ENV`): switches are off at "0"; rows are
    integers (GEMV rows clamped to 1..16, as always); GDN verify is "chunk" or else recurrent; FP8 one of `FP8`."""
    name = ENV[var]
    if name in ("kernels", "tune", "fla", "dependent_launch"):
        return text != "0"
    if name == "gdn_verify":
        return "chunk" if text == "chunk" else "recurrent"
    if name == "fp8":
        if text not in FP8:
            raise ConfigError(f"{var}={text!r} is not one of {', '.join(FP8)}", hint=f"unset {var}")
        return text
    try:
        rows = int(text)
    except ValueError:
        raise ConfigError(f"{var}={text!r} is not a whole number of rows", hint=f"unset {var}") from None
    return min(16, max(1, rows)) if name == "gemv_rows" else rows


@dataclass(frozen=True)
class EngineOptions:
    """Which engine a caller asks for. fast: True (the static engine wherever it can run, CPU included: no
    graphs there), False (always the eager engine), None (auto: the static engine on CUDA). `fast_options`: how
    the static engine runs."""

    fast: bool | None = None
    fast_options: FastOptions = FastOptions()

    @property
    def compile(self) -> bool:
        return self.fast_options.compile
