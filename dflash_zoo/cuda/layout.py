"""A target's `StaticLayout` (adapters/base.py) resolved against its loaded modules, for the static engine.

Every module name the fast path uses is looked up here, through the names the adapter declares; nothing about
a family's module layout is written into static.py or fast.py. A layout that names a module the target lacks
fails when the engine is built, with the layer and the name, rather than deep inside a step.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_zoo.errors import UnsupportedModelError

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import StaticLayout, TargetAdapter


class LayerModules(NamedTuple):
    """One decoder layer's modules as the static engine runs them."""

    input_norm: nn.Module
    post_norm: nn.Module
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    qk_norm: tuple[nn.Module, nn.Module] | None  # per-head RMSNorms of q and k; None: none
    scaling: float  # the softmax scale
    mlp: nn.Module  # the MLP module; a sparse MoE block (gate is None) runs as this module
    gate: nn.Linear | None
    up: nn.Linear | None
    down: nn.Linear | None
    act: Callable[[torch.Tensor], torch.Tensor] | None


class TargetModules(NamedTuple):
    """The resolved target: per-layer modules, the final norm, the rotary embedding and the config numbers."""

    layers: list[LayerModules]
    final_norm: nn.Module
    rotary_emb: nn.Module
    head_dim: int
    eps: float  # every RMSNorm's epsilon
    silu: bool  # the dense MLPs' activation is SiLU: the fused SiLU kernels apply


def _name(adapter: TargetAdapter) -> str:
    return repr(adapter.model_types[0]) if adapter.model_types else type(adapter).__name__


def _lookup(adapter: TargetAdapter, obj: Any, path: str, where: str) -> Any:
    """`obj.<path>` (dotted), or an error naming the adapter, the place and the missing name."""
    try:
        return operator.attrgetter(path)(obj)
    except AttributeError:
        raise UnsupportedModelError(
            f"the static layout of the {_name(adapter)} adapter names {where}.{path}, "
            f"which this target ({type(obj).__name__}) does not have",
            hint=f"fix `static_layout` in {type(adapter).__module__}, or set it to None (the eager loop runs it)",
        ) from None


def _get(obj: Any, path: str) -> Any:
    try:
        return operator.attrgetter(path)(obj)
    except AttributeError:
        return None


def _linear(adapter: TargetAdapter, obj: Any, path: str, where: str) -> nn.Linear:
    mod = _lookup(adapter, obj, path, where)
    if not isinstance(mod, nn.Linear):  # fusion and the GEMV kernel read weight / bias / out_features
        raise UnsupportedModelError(
            f"the static layout of the {_name(adapter)} adapter names {where}.{path} as a projection, "
            f"but it is a {type(mod).__name__}, not an nn.Linear",
            hint=f"fix `static_layout` in {type(adapter).__module__}",
        )
    return mod


def _is_sparse(layout: StaticLayout, mlp: Any) -> bool:
    return layout.moe is not None and hasattr(mlp, layout.moe.experts)


def _layer(adapter: TargetAdapter, layout: StaticLayout, i: int, layer: nn.Module) -> LayerModules:
    at, where = layout.attention, f"layer {i}"
    attn = _lookup(adapter, layer, at.path, where)
    aw = f"{where}.{at.path}"
    q, k, v, o = (_linear(adapter, attn, n, aw) for n in (at.q_proj, at.k_proj, at.v_proj, at.o_proj))
    qk = None
    if at.q_norm is not None:
        qk = (_lookup(adapter, attn, at.q_norm, aw), _lookup(adapter, attn, at.k_norm, aw))
    mlp = _lookup(adapter, layer, layout.mlp_path, where)
    gate = up = down = act = None
    if not _is_sparse(layout, mlp):
        if layout.mlp is None:
            raise UnsupportedModelError(
                f"{where}'s MLP ({type(mlp).__name__}) has no {layout.moe.experts!r} child, and the static "
                f"layout of the {_name(adapter)} adapter declares no dense MLP",
                hint=f"fix `static_layout` in {type(adapter).__module__}",
            )
        mw, g = f"{where}.{layout.mlp_path}", layout.mlp
        gate, up, down = (_linear(adapter, mlp, n, mw) for n in (g.gate_proj, g.up_proj, g.down_proj))
        act = _lookup(adapter, mlp, g.act_fn, mw)
    return LayerModules(
        _lookup(adapter, layer, layout.input_norm, where),
        _lookup(adapter, layer, layout.post_attention_norm, where),
        q, k, v, o, qk,
        _lookup(adapter, attn, at.scaling, aw),
        mlp, gate, up, down, act,
    )  # fmt: skip


def resolve(adapter: TargetAdapter) -> TargetModules:
    """Look up every module the static engine runs, through the adapter's declared layout."""
    layout = type(adapter).static_layout
    if layout is None:
        raise UnsupportedModelError(f"no static layout declared by the {_name(adapter)} adapter")
    text, model = adapter.text_config, adapter.model
    layers = [_layer(adapter, layout, i, layer) for i, layer in enumerate(adapter.layers())]
    attn0 = _lookup(adapter, adapter.layers()[0], layout.attention.path, "layer 0")
    act = getattr(text, layout.mlp.activation, None) if layout.mlp is not None else None
    return TargetModules(
        layers=layers,
        final_norm=_lookup(adapter, model, adapter.final_norm_path(), "the model"),
        rotary_emb=_lookup(adapter, model, layout.rotary_emb, "the model"),
        head_dim=_lookup(adapter, attn0, layout.attention.head_dim, f"layer 0.{layout.attention.path}"),
        eps=_lookup(adapter, text, layout.norm_eps, "the text config"),
        silu=act in ("silu", "swish"),
    )


# ---- whether the fast path can run a target ----------------------------------------------------------------
def layout_reason(adapter: TargetAdapter) -> str | None:
    """Why the static engine cannot run this target's decoder (None: its declared layout covers it)."""
    layout = type(adapter).static_layout
    if layout is None:
        return f"no static layout declared by the {_name(adapter)} adapter"
    types = getattr(adapter.text_config, "layer_types", None) or []
    other = sorted({t for t in types if t not in layout.layer_types})
    if other:
        return f"target has {', '.join(other)} layers; the static layout runs {', '.join(layout.layer_types)}"
    return None


def graph_unsafe_reason(adapter: TargetAdapter) -> str | None:
    """Why a step of this target would sync with the host, so cannot be captured (None: it would not).

    Only sparse MoE blocks can, through their HF experts implementation (transformers `integrations/moe.py`):
    `batched_mm` gathers each token's experts (no sync); `grouped_mm` counts tokens per expert with `histc` and
    runs torch's grouped GEMM (no sync), but in another dtype than bf16, or without torch's grouped GEMM, it
    falls back to a loop over `offsets.tolist()`; `eager` loops over the experts a step hit.
    """
    layout = type(adapter).static_layout
    if layout is None or layout.moe is None:
        return None
    mlps = [_get(layer, layout.mlp_path) for layer in adapter.layers()]  # a missing one: `resolve` says so
    sparse = [m for m in mlps if _is_sparse(layout, m)]
    if not sparse:
        return None
    impl = getattr(adapter.text_config, layout.moe.implementation, None)
    dtype = next(sparse[0].parameters()).dtype
    has_grouped = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")
    if impl == "batched_mm" or (impl == "grouped_mm" and dtype == torch.bfloat16 and has_grouped):
        return None
    return (
        f"experts implementation {impl!r} in {str(dtype).removeprefix('torch.')} syncs with the host every step; "
        "model.set_experts_implementation('batched_mm') makes it capturable"
    )
