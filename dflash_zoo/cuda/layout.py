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
    """One decoder layer's modules as the static engine runs them: attention (q/k/v/o set) or a
    Gated-DeltaNet layer (`gdn` set), then a dense MLP (gate/up/down set) or a sparse MoE block."""

    kind: str  # its `layer_types` entry: full_attention, sliding_attention or linear_attention
    input_norm: nn.Module
    post_norm: nn.Module
    q: nn.Linear | None
    k: nn.Linear | None
    v: nn.Linear | None
    o: nn.Linear | None
    qk_norm: tuple[nn.Module, nn.Module] | None  # RMSNorms of q and k; None: none
    qk_norm_per_head: bool  # the q/k norms run per head (else over all heads, before the head split)
    scaling: float | None  # the softmax scale
    window: int | None  # sliding layers: keys within `window` positions of the query (the query included)
    sinks: torch.Tensor | None  # [heads] per-head sink logits; None: none
    output_gate: bool  # q_proj emits [query | gate] per head; the output is attn * sigmoid(gate)
    gdn: nn.Module | None  # a linear-attention layer's GDN module
    gdn_parts: tuple[nn.Module, nn.Module, nn.Module] | None  # its (conv1d, gated norm, out_proj)
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
    layout: StaticLayout


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


def layer_kinds(adapter: TargetAdapter) -> list[str]:
    """Each decoder layer's `layer_types` entry (all `full_attention` when the config has none)."""
    types = getattr(adapter.text_config, "layer_types", None)
    return list(types) if types else ["full_attention"] * len(adapter.layers())


def _attention(adapter: TargetAdapter, layout: StaticLayout, kind: str, layer: nn.Module, where: str) -> dict:
    at = layout.attention
    attn = _lookup(adapter, layer, at.path, where)
    aw = f"{where}.{at.path}"
    q, k, v, o = (_linear(adapter, attn, n, aw) for n in (at.q_proj, at.k_proj, at.v_proj, at.o_proj))
    qk = None
    if at.q_norm is not None:
        qk = (_lookup(adapter, attn, at.q_norm, aw), _lookup(adapter, attn, at.k_norm, aw))
    window = None
    if kind == "sliding_attention":
        window = int(_lookup(adapter, adapter.text_config, layout.sliding_window, "the text config"))
    sinks = _lookup(adapter, attn, at.sinks, aw) if at.sinks is not None else None
    scaling = _lookup(adapter, attn, at.scaling, aw)
    return dict(q=q, k=k, v=v, o=o, qk_norm=qk, qk_norm_per_head=at.qk_norm_per_head, scaling=scaling,
                window=window, sinks=sinks, output_gate=at.output_gate)  # fmt: skip


def _linear_attention(adapter: TargetAdapter, layout: StaticLayout, layer: nn.Module, where: str) -> dict:
    ln = layout.linear
    gdn = _lookup(adapter, layer, ln.path, where)
    gw = f"{where}.{ln.path}"
    parts = (_lookup(adapter, gdn, ln.conv1d, gw), _lookup(adapter, gdn, ln.norm, gw))
    for name in (ln.a_log, ln.dt_bias):
        _lookup(adapter, gdn, name, gw)
    if not callable(getattr(adapter, "gdn_project", None)):
        raise UnsupportedModelError(
            f"the {_name(adapter)} adapter declares linear-attention layers but no `gdn_project`",
            hint=f"add gdn_project(gdn, x) -> (conv input, z, b, a) to {type(adapter).__module__}",
        )
    return dict(gdn=gdn, gdn_parts=(*parts, _linear(adapter, gdn, ln.out_proj, gw)))


def _layer(adapter: TargetAdapter, layout: StaticLayout, i: int, kind: str, layer: nn.Module) -> LayerModules:
    where = f"layer {i}"
    mixer = dict(q=None, k=None, v=None, o=None, qk_norm=None, qk_norm_per_head=True, scaling=None, window=None,
                 sinks=None, output_gate=False, gdn=None, gdn_parts=None)  # fmt: skip
    if kind == "linear_attention":
        mixer.update(_linear_attention(adapter, layout, layer, where))
    else:
        mixer.update(_attention(adapter, layout, kind, layer, where))
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
        kind=kind,
        input_norm=_lookup(adapter, layer, layout.input_norm, where),
        post_norm=_lookup(adapter, layer, layout.post_attention_norm, where),
        **mixer, mlp=mlp, gate=gate, up=up, down=down, act=act,
    )  # fmt: skip


def resolve(adapter: TargetAdapter) -> TargetModules:
    """Look up every module the static engine runs, through the adapter's declared layout."""
    layout = type(adapter).static_layout
    if layout is None:
        raise UnsupportedModelError(f"no static layout declared by the {_name(adapter)} adapter")
    text, model = adapter.text_config, adapter.model
    kinds = layer_kinds(adapter)
    layers = [_layer(adapter, layout, i, kinds[i], layer) for i, layer in enumerate(adapter.layers())]
    first = next((i for i, kind in enumerate(kinds) if kind != "linear_attention"), None)
    head_dim = 0  # no attention layer: no K/V buffers
    if first is not None:
        attn = _lookup(adapter, adapter.layers()[first], layout.attention.path, f"layer {first}")
        head_dim = _lookup(adapter, attn, layout.attention.head_dim, f"layer {first}.{layout.attention.path}")
    act = getattr(text, layout.mlp.activation, None) if layout.mlp is not None else None
    return TargetModules(
        layers=layers,
        final_norm=_lookup(adapter, model, adapter.final_norm_path(), "the model"),
        rotary_emb=_lookup(adapter, model, layout.rotary_emb, "the model"),
        head_dim=head_dim,
        eps=_lookup(adapter, text, layout.norm_eps, "the text config"),
        silu=act in ("silu", "swish"),
        layout=layout,
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


def cuda_unverified_reason(adapter: TargetAdapter) -> str | None:
    """Why the static engine should not be this target's default on CUDA although it can run it (None: no
    reason). Gated-DeltaNet layers are verified token for token on CPU (fp32) only: their first H200 run failed
    on a transformers 5.17 difference (its Qwen3.5 rotary embedding takes mRoPE position ids only), fixed and
    tested since on CPU, but neither flash-linear-attention's kernels nor CUDA graphs of those layers have run
    since, so CUDA users get them only by asking (`fast=True`)."""
    layout = type(adapter).static_layout
    if layout is not None and layout.linear is not None and "linear_attention" in layer_kinds(adapter):
        return "the static engine's Gated-DeltaNet layers are verified on CPU only, not yet on CUDA"
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
