"""Which targets and drafters the static engine (cuda/static/) can run, read from their declarations only.

The answers come from the adapter's `static_layout` (adapters/base.py), the target's config and modules, and
the drafter class's `static_supported`; nothing here imports the static engine, so engine selection
(`select.py`) asks these questions without loading the CUDA wing, and the static engine asks the same ones
before it builds anything (a target it refuses is refused with the same reason).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from dflash_zoo.adapters.base import SparseMoE
from dflash_zoo.engine.run import rope_switch

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import StaticLayout, TargetAdapter


def adapter_name(adapter: TargetAdapter) -> str:
    """The adapter's first model type, quoted, for messages (its class name when it registers none)."""
    return repr(adapter.model_types[0]) if adapter.model_types else type(adapter).__name__


def layer_kinds(adapter: TargetAdapter) -> list[str]:
    """Each decoder layer's `layer_types` entry (all `full_attention` when the config has none)."""
    types = getattr(adapter.text_config, "layer_types", None)
    return list(types) if types else ["full_attention"] * len(adapter.layers())


def is_sparse(layout: StaticLayout, mlp: Any) -> bool:
    """Whether a layer's MLP module is a sparse MoE block of the layout (it has the declared experts child)."""
    return layout.moe is not None and hasattr(mlp, layout.moe.experts)


def _get(obj: Any, path: str) -> Any:
    try:
        return operator.attrgetter(path)(obj)
    except AttributeError:
        return None


def layout_reason(adapter: TargetAdapter) -> str | None:
    """Why the static engine cannot run this target's decoder (None: its declared layout covers it)."""
    layout = type(adapter).static_layout
    if layout is None:
        return f"no static layout declared by the {adapter_name(adapter)} adapter"
    other = sorted({t for t in layer_kinds(adapter) if t not in layout.layer_types})
    if other:
        return f"target has {', '.join(other)} layers; the static layout runs {', '.join(layout.layer_types)}"
    return None


def cuda_unverified_reason(adapter: TargetAdapter) -> str | None:
    """Why the static engine should not be this target's default on CUDA although it can run it (None: no
    reason): its layout has not passed the GPU tests yet (`StaticLayout.cuda_verified`)."""
    layout = type(adapter).static_layout
    if layout is not None and not layout.cuda_verified:
        return f"the static layout of the {adapter_name(adapter)} adapter is verified on CPU only, not yet on CUDA"
    return None


def graph_unsafe_reason(adapter: TargetAdapter) -> str | None:
    """Why a step of this target would sync with the host, so cannot be captured (None: it would not).

    Only sparse MoE blocks can, through their HF experts implementation (transformers `integrations/moe.py`):
    `batched_mm` gathers each token's experts (no sync); `grouped_mm` counts tokens per expert with `histc` and
    runs torch's grouped GEMM (no sync), but in another dtype than bf16, or without torch's grouped GEMM, it
    falls back to a loop over `offsets.tolist()`; `eager` loops over the experts a step hit.
    """
    layout = type(adapter).static_layout
    if layout is None or (layout.moe is None and layout.parallel_moe is None):
        return None
    sparse = []  # a missing module: the layout's resolution says so
    for layer in adapter.layers():
        mlp = _get(layer, layout.mlp_path)
        if layout.moe is not None and is_sparse(layout, mlp):
            sparse.append(mlp)
        pm = layout.parallel_moe
        if pm is not None and _get(layer, pm.enabled):
            sparse.append(_get(layer, pm.experts))
    if not sparse:
        return None
    impl = getattr(adapter.text_config, (layout.moe or SparseMoE()).implementation, None)
    dtype = next(sparse[0].parameters()).dtype
    has_grouped = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")
    if impl == "batched_mm" or (impl == "grouped_mm" and dtype == torch.bfloat16 and has_grouped):
        return None
    return (
        f"experts implementation {impl!r} in {str(dtype).removeprefix('torch.')} syncs with the host every step; "
        "model.set_experts_implementation('batched_mm') makes it capturable"
    )


def unsupported_reason(adapter: TargetAdapter, graphs: bool = False) -> str | None:
    """Why the fast engine cannot run this target (None: it can); `graphs`: its steps are to be CUDA graphs.

    Decoding modes never decide it: greedy and sampling run the same captured steps.
    """
    reason = layout_reason(adapter)  # no declared static layout, or layer types it does not cover
    if reason:
        return reason
    switch = rope_switch(adapter.config)
    if switch is not None:  # the static engine verifies whole blocks; the eager one stops them at the switch
        return f"longrope rotary switches its factors at position {switch}, which whole-block verifies would cross"
    return graph_unsafe_reason(adapter) if graphs else None


def drafter_reason(drafter: Any) -> str | None:
    """Why the static engine cannot run this drafter (None: it can): its class says the static drafter does not
    cover its architecture yet (`static_supported`)."""
    if drafter.static_supported:
        return None
    return f"the static drafter does not run {drafter.arch} drafters yet"
