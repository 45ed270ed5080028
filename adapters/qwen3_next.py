"""Qwen3-Next targets (Qwen/Qwen3-Coder-Next; `Qwen3NextForCausalLM`, mirrors transformers
`models/qwen3_next/modeling_qwen3_next.py`).

Quirks:
- hybrid layers (3 Gated-DeltaNet : 1 gated full attention) with the same GDN recurrence as Qwen3.5, so the
  same exact rollback (`_hybrid.py`); a negative `crop` alone would be silently wrong;
- the GDN projections are fused and head-interleaved: `in_proj_qkvz` holds [q | k | v | z] per key-head group
  and `in_proj_ba` holds [b | a] per group. The recompute rollback hooks these two and unpacks them with the
  module's own `fix_query_key_value_ordering`, so the conv input is rebuilt as [q | k | v] exactly as forward does;
- the published drafter taps [3, 11, 23, 35, 43]: these sit on full-attention layers (index = 3 mod 4), unlike
  the usual `1 + k * step` spread. Taps are taken as given, never normalised;
- fast path: the layout of Qwen3.5 (`qwen3_5_text.HYBRID_LAYOUT`: zero-centred norms, gated attention, GDN
  over static states) with plain 1-D rotary positions (no mRoPE); `gdn_split` unpacks the fused projections' outputs as forward does;
- MoE MLPs (512 experts, top-10 plus a shared expert); Qwen3-Coder has no thinking mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_zoo.adapters import register
from dflash_zoo.adapters._hybrid import HybridGDNAdapter
from dflash_zoo.adapters.qwen3_5_text import HYBRID_LAYOUT


@register("qwen3_next")
class Qwen3NextAdapter(HybridGDNAdapter):
    gdn_capture = ("in_proj_qkvz", "in_proj_ba")
    registry_shape = {"gdn_every": 4}  # 3 Gated-DeltaNet layers, then 1 full attention

    static_layout = dataclasses.replace(
        HYBRID_LAYOUT,
        rotary_axes=0,  # a plain (1-D) rotary embedding
        moe=dataclasses.replace(HYBRID_LAYOUT.moe, renormalize="norm_topk_prob"),  # its router has the flag
        linear=dataclasses.replace(HYBRID_LAYOUT.linear, in_proj=("in_proj_qkvz", "in_proj_ba")),
    )

    def gdn_inputs(self, gdn: Any, seen: dict[str, Any]) -> tuple[Any, Any, Any]:
        mixed, _z, b, a = _unpack(gdn, seen["in_proj_qkvz"], seen["in_proj_ba"])
        return mixed, a, b  # a, b: [B, T, Hv]

    def gdn_split(self, gdn: Any, outs: tuple[Any, ...]) -> tuple[Any, Any, Any, Any]:
        qkvz, ba = (y.contiguous() for y in outs)  # column slices of one GEMM; the unpacking views them
        return _unpack(gdn, qkvz, ba)


def _unpack(gdn: Any, qkvz: Any, ba: Any) -> tuple[Any, Any, Any, Any]:
    """The fused projections -> (conv input [B, T, 2 Kd + Vd] as [q | k | v], z [B, T, Hv, Dv], b, a [B, T, Hv])."""
    import torch

    q, k, v, z, b, a = gdn.fix_query_key_value_ordering(qkvz, ba)
    return torch.cat([y.reshape(*y.shape[:2], -1) for y in (q, k, v)], dim=-1), z, b, a
