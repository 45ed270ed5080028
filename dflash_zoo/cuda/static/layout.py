"""A target's `StaticLayout` (adapters/base.py) resolved against its loaded modules, for the static engine.

Every module name the fast path uses is looked up here (the MoE parts in layout_moe.py), through the names the
adapter declares; nothing about a family's module layout is written into the engine's other modules. A layout
that names a module the target lacks fails when the engine is built, with the layer and the name, rather than
deep inside a step. Whether the engine can run a target at all: engine/static_support.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from dflash_zoo.adapters.base import EXPERT_GATES, TargetAdapter
from dflash_zoo.cuda.static.layout_moe import (
    ExpertGate,
    MoEParts,
    ScaledRouting,
    resolve_expert_gate,
    resolve_moe,
    resolve_scaled_routing,
)
from dflash_zoo.cuda.static.lookup import lookup, lookup_linear
from dflash_zoo.engine.static_support import adapter_name, is_sparse, layer_kinds
from dflash_zoo.errors import UnsupportedModelError

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import StaticLayout


class LayerModules(NamedTuple):
    """One decoder layer's modules as the static engine runs them: attention (q/k/v/o set) or a
    Gated-DeltaNet layer (`gdn` set), then a dense MLP (gate/up/down set) or a sparse MoE block."""

    kind: str  # its `layer_types` entry: full_attention, sliding_attention or linear_attention
    input_norm: nn.Module
    post_norm: nn.Module
    q: nn.Linear | None
    k: nn.Linear | None  # None on a KV-shared layer
    v: nn.Linear | None  # None on a KV-shared layer, or where the values are the keys (k_eq_v)
    o: nn.Linear | None
    head_dim: int | None
    qk_norm: (
        tuple[nn.Module, nn.Module | None] | None
    )  # RMSNorms of q and k (k's None: KV-shared); None: none
    v_norm: nn.Module | None
    kv_source: int | None  # a KV-shared layer: the layer whose K/V buffers it reads (it writes none)
    qk_norm_per_head: bool  # the q/k norms run per head (else over all heads, before the head split)
    scaling: float | None  # the softmax scale
    window: int | None  # sliding layers: keys within `window` positions of the query (the query included)
    sinks: torch.Tensor | None  # [heads] per-head sink logits; None: none
    output_gate: bool  # q_proj emits [query | gate] per head; the output is attn * sigmoid(gate)
    gdn: nn.Module | None  # a linear-attention layer's GDN module
    # its (conv1d, gated norm, out_proj, input projections in `gdn_split`'s order)
    gdn_parts: tuple[nn.Module, nn.Module, nn.Module, tuple[nn.Linear, ...]] | None
    mlp: nn.Module  # the MLP module; a sparse MoE block (gate is None) runs as this module
    gate: nn.Linear | None
    up: nn.Linear | None
    down: nn.Linear | None
    act: Callable[[torch.Tensor], torch.Tensor] | None
    attn_out_norm: nn.Module | None = None  # sandwich norms (Gemma) on the sublayer outputs
    mlp_out_norm: nn.Module | None = None
    moe_branch: tuple[nn.Module, ...] | None = (
        None  # (router, experts, dense out, experts in, experts out norms)
    )
    branch_routing: ScaledRouting | None = None  # the branch router's declared parts; None: the module runs
    branch_gate: ExpertGate | None = None  # the branch experts' declared activation (in the down kernel)
    moe_parts: MoEParts | None = (
        None  # a sparse block's parts for the MoE kernels; None: it runs as its module
    )
    per_layer: tuple[nn.Module, ...] | None = None  # (gate, projection, norm, act) of the per-layer input
    scalar: torch.Tensor | None = None  # multiplies the layer's output


class TargetModules(NamedTuple):
    """The resolved target: per-layer modules, the final norm, the rotary embedding and the config numbers."""

    layers: list[LayerModules]
    final_norm: nn.Module
    rotary_emb: nn.Module
    eps: float  # every RMSNorm's epsilon
    activation: str | None  # the kernels' name of the dense MLPs' activation ("silu", "gelu_tanh"), or None
    layout: StaticLayout


def _attention(adapter: TargetAdapter, layout: StaticLayout, kind: str, layer: nn.Module, where: str) -> dict:
    at = layout.attention
    attn = lookup(adapter, layer, at.path, where)
    aw = f"{where}.{at.path}"
    shared = bool(at.kv_shared is not None and lookup(adapter, attn, at.kv_shared, aw))
    q, o = (lookup_linear(adapter, attn, n, aw) for n in (at.q_proj, at.o_proj))
    k = v = None
    if not shared:
        k = lookup_linear(adapter, attn, at.k_proj, aw)
        if not (
            at.k_eq_v and lookup(adapter, attn, at.v_proj, aw) is None
        ):  # k_eq_v: no v_proj, values = keys
            v = lookup_linear(adapter, attn, at.v_proj, aw)
    qk = None
    if at.q_norm is not None:
        qk = (
            lookup(adapter, attn, at.q_norm, aw),
            None if shared else lookup(adapter, attn, at.k_norm, aw),
        )
    v_norm = lookup(adapter, attn, at.v_norm, aw) if at.v_norm is not None and not shared else None
    window = None
    if kind == "sliding_attention":
        window = int(lookup(adapter, adapter.text_config, layout.sliding_window, "the text config"))
    sinks = lookup(adapter, attn, at.sinks, aw) if at.sinks is not None else None
    scaling = lookup(adapter, attn, at.scaling, aw)
    head_dim = int(lookup(adapter, attn, at.head_dim, aw))
    return dict(q=q, k=k, v=v, o=o, head_dim=head_dim, qk_norm=qk, v_norm=v_norm, kv_source=-1 if shared else None,
                qk_norm_per_head=at.qk_norm_per_head, scaling=scaling, window=window, sinks=sinks,
                output_gate=at.output_gate)  # fmt: skip


def _linear_attention(adapter: TargetAdapter, layout: StaticLayout, layer: nn.Module, where: str) -> dict:
    ln = layout.linear
    gdn = lookup(adapter, layer, ln.path, where)
    gw = f"{where}.{ln.path}"
    parts = (lookup(adapter, gdn, ln.conv1d, gw), lookup(adapter, gdn, ln.norm, gw))
    for name in (ln.a_log, ln.dt_bias):
        lookup(adapter, gdn, name, gw)
    if type(adapter).gdn_split is TargetAdapter.gdn_split:  # the contract's default: not declared
        raise UnsupportedModelError(
            f"the {adapter_name(adapter)} adapter declares linear-attention layers but no `gdn_split`",
            hint=f"add gdn_split(gdn, in_proj outputs) -> (conv input, z, b, a) to {type(adapter).__module__}",
        )
    projections = tuple(lookup_linear(adapter, gdn, name, gw) for name in ln.in_proj)
    return dict(gdn=gdn, gdn_parts=(*parts, lookup_linear(adapter, gdn, ln.out_proj, gw), projections))


def _layer(adapter: TargetAdapter, layout: StaticLayout, i: int, kind: str, layer: nn.Module) -> LayerModules:
    where = f"layer {i}"
    mixer = dict(q=None, k=None, v=None, o=None, head_dim=None, qk_norm=None, v_norm=None, kv_source=None,
                 qk_norm_per_head=True, scaling=None, window=None, sinks=None, output_gate=False, gdn=None,
                 gdn_parts=None)  # fmt: skip
    if kind == "linear_attention":
        mixer.update(_linear_attention(adapter, layout, layer, where))
    else:
        mixer.update(_attention(adapter, layout, kind, layer, where))
    mlp = lookup(adapter, layer, layout.mlp_path, where)
    gate = up = down = act = moe_parts = None
    if is_sparse(layout, mlp):
        moe_parts = resolve_moe(adapter, layout, mlp, f"{where}.{layout.mlp_path}")
    elif layout.mlp is None:
        raise UnsupportedModelError(
            f"{where}'s MLP ({type(mlp).__name__}) has no {layout.moe.experts!r} child, and the static "
            f"layout of the {adapter_name(adapter)} adapter declares no dense MLP",
            hint=f"fix `static_layout` in {type(adapter).__module__}",
        )
    else:
        mw, g = f"{where}.{layout.mlp_path}", layout.mlp
        gate, up, down = (lookup_linear(adapter, mlp, n, mw) for n in (g.gate_proj, g.up_proj, g.down_proj))
        act = lookup(adapter, mlp, g.act_fn, mw)
    return LayerModules(
        kind=kind,
        input_norm=lookup(adapter, layer, layout.input_norm, where),
        post_norm=lookup(adapter, layer, layout.post_attention_norm, where),
        **mixer, mlp=mlp, gate=gate, up=up, down=down, act=act, moe_parts=moe_parts,
        **_extras(adapter, layout, layer, where),
    )  # fmt: skip


def _extras(adapter: TargetAdapter, layout: StaticLayout, layer: nn.Module, where: str) -> dict:
    """Sandwich norms, a parallel MoE branch, a per-layer input and a layer scalar, where declared."""
    get = lambda name: lookup(adapter, layer, name, where)  # noqa: E731
    out: dict[str, Any] = {}
    if layout.sandwich is not None:
        out |= dict(
            attn_out_norm=get(layout.sandwich.attention_out), mlp_out_norm=get(layout.sandwich.mlp_out)
        )
    pm = layout.parallel_moe
    if pm is not None and get(pm.enabled):
        names = (pm.router, pm.experts, pm.dense_out_norm, pm.experts_in_norm, pm.experts_out_norm)
        out["moe_branch"] = tuple(get(n) for n in names)
        if pm.routing is not None:
            out["branch_routing"] = resolve_scaled_routing(
                adapter, pm.routing, out["moe_branch"][0], f"{where}.{pm.router}"
            )
        out["branch_gate"] = resolve_expert_gate(adapter, pm.expert_gate, pm.activation, out["moe_branch"][1])
    pli = layout.per_layer_input
    if pli is not None and getattr(adapter.text_config, pli.width, None):
        out["per_layer"] = tuple(get(n) for n in (pli.gate, pli.projection, pli.norm, pli.act))
    if layout.layer_scalar is not None:
        out["scalar"] = get(layout.layer_scalar)
    return out


def _link_shared_kv(
    adapter: TargetAdapter, layout: StaticLayout, layers: list[LayerModules]
) -> list[LayerModules]:
    """Point each KV-shared layer at the layer of its type that stores K/V for it."""
    at = layout.attention
    if at.kv_shared is None:
        return layers
    store = {}
    for i, (m, layer) in enumerate(zip(layers, adapter.layers(), strict=True)):
        attn = lookup(adapter, layer, at.path, f"layer {i}")
        if m.kv_source is None and m.q is not None and at.kv_store and getattr(attn, at.kv_store, False):
            store[m.kind] = i
    out = []
    for i, m in enumerate(layers):
        if m.kv_source == -1:
            if m.kind not in store:
                raise UnsupportedModelError(
                    f"KV-shared layer {i} ({m.kind}) has no earlier layer storing its K/V"
                )
            m = m._replace(kv_source=store[m.kind])
        out.append(m)
    return out


def resolve(adapter: TargetAdapter) -> TargetModules:
    """Look up every module the static engine runs, through the adapter's declared layout."""
    layout = type(adapter).static_layout
    if layout is None:
        raise UnsupportedModelError(f"no static layout declared by the {adapter_name(adapter)} adapter")
    text, model = adapter.text_config, adapter.model
    kinds = layer_kinds(adapter)
    layers = [_layer(adapter, layout, i, kinds[i], layer) for i, layer in enumerate(adapter.layers())]
    layers = _link_shared_kv(adapter, layout, layers)
    act = getattr(text, layout.mlp.activation, None) if layout.mlp is not None else None
    return TargetModules(
        layers=layers,
        final_norm=lookup(adapter, model, adapter.final_norm_path(), "the model"),
        rotary_emb=lookup(adapter, model, layout.rotary_emb, "the model"),
        eps=lookup(adapter, text, layout.norm_eps, "the text config"),
        activation=next((kind for kind, acts in EXPERT_GATES.items() if acts and act in acts), None),
        layout=layout,
    )
