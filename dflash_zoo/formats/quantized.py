"""Quantized drafters: refused by default, with the public evidence; FP8 block-scaled ones dequantized on request.

A drafter is quantized when its config has a `quantization_config` or its checkpoint holds non-float tensors
other than a vocabulary map (`d2t`, `t2d`). Published evidence that running one goes wrong silently: SGLang
0.5.19 ran a W4A16 DFlash 2 drafter at about 0% acceptance with no warning (sgl-project/sglang#39087, where the
bf16 drafter accepted 5.25 tokens per step), and vLLM failed to load quantized DFlash drafters
(vllm-project/vllm#53116, #53107, #51581: the quantization config did not reach the drafter's fused modules).

With `allow` (`--allow-quantized-drafter`), only what dflash-zoo can compute exactly runs: FP8 weights
(float8_e4m3fn / e5m2) with a per-tensor or per-block scale (`weight_scale_inv`, transformers' `fp8` method, or
`weight_scale`, compressed-tensors' float-quantized one) become weight * scale in fp32, as transformers'
`Fp8Dequantize` computes them; activations then stay in the compute dtype (weight-only). Packed integer or 4-bit
weights, zero points and static activation scales are refused, named.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_zoo.errors import DrafterFormatError
from dflash_zoo.quantization import EVIDENCE, VOCAB_MAPS

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALES = ("_scale_inv", "_scale")


class QuantizedDrafterError(DrafterFormatError):
    """A quantized drafter, refused (by default, or because its format cannot be dequantized exactly)."""


def quantization(raw: dict[str, Any], state: dict[str, torch.Tensor]) -> str | None:
    """What says a drafter is quantized: its config's quant method, or its first non-float tensor; None: not."""
    qcfg = raw.get("quantization_config")
    if isinstance(qcfg, dict):
        return f"quantization_config quant_method {qcfg.get('quant_method', 'unknown')!r}"
    odd = next((k for k, t in state.items() if k not in VOCAB_MAPS and not t.is_floating_point()), None)
    if odd is None:
        odd = next((k for k, t in state.items() if t.dtype in _FP8), None)
    return None if odd is None else f"tensor {odd} is {str(state[odd].dtype).removeprefix('torch.')}"


def admit(raw: dict[str, Any], state: dict[str, torch.Tensor], allow: bool) -> dict[str, torch.Tensor]:
    """The drafter's tensors to load: as they are when not quantized, dequantized when allowed and possible."""
    why = quantization(raw, state)
    if why is None:
        return state
    if not allow:
        raise QuantizedDrafterError(
            f"this drafter is quantized ({why}); quantized drafters are refused because {EVIDENCE}",
            hint="use the bf16 drafter (quantized targets keep their acceptance with one), or pass "
            "--allow-quantized-drafter (Python: allow_quantized_drafter=True) to try it",
        )
    return dequantize(state)


def dequantize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 weights times their scales (fp32); anything else quantized is refused by name."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name, t in state.items():
        if name in used or any(name.endswith(s) for s in _SCALES):
            continue
        if t.dtype in _FP8:
            scale_name = next((f"{name}{s}" for s in _SCALES if f"{name}{s}" in state), None)
            if scale_name is None:
                raise QuantizedDrafterError(
                    f"FP8 tensor {name} has no {name}_scale_inv / {name}_scale beside it"
                )
            out[name] = _times_scale(t, state[scale_name], name)
            used.add(scale_name)
        elif t.is_floating_point() or name in VOCAB_MAPS:
            out[name] = t
        else:
            raise QuantizedDrafterError(
                f"tensor {name} is {str(t.dtype).removeprefix('torch.')}: packed integer weights are a format "
                "dflash-zoo does not dequantize (it runs FP8 block-scaled drafters only)"
            )
    stray = sorted(k for k in state if k not in out and k not in used)
    if stray:
        raise QuantizedDrafterError(
            f"quantized drafter tensors dflash-zoo cannot account for: {', '.join(stray[:4])} (activation scales "
            "or zero points: not a weight-only FP8 format)"
        )
    return out


def _times_scale(w: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """[N, K] FP8 weight times a per-tensor scale or a [N / bn, K / bk] block grid, in fp32."""
    wf = w.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return wf * s.reshape(())
    if s.dim() != 2 or w.dim() != 2 or w.shape[0] % s.shape[0] or w.shape[1] % s.shape[1]:
        raise QuantizedDrafterError(
            f"scale of {name} {tuple(s.shape)} does not tile its weight {tuple(w.shape)}"
        )
    bn, bk = w.shape[0] // s.shape[0], w.shape[1] // s.shape[1]
    return wf * s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)  # [N, K]
