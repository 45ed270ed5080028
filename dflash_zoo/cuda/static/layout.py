"""A target's `StaticLayout` (adapters/base.py) resolved against its loaded modules, for the static engine.

Every module name the fast path uses is looked up here, through the names the adapter declares; nothing about
a family's module layout is written into static.py or fast.py. A layout that names a module the target lacks
fails when the engine is built, with the layer and the name, rather than deep inside a step.

A little over the ~300 lines we aim for: one resolver per declared part (attention, GDN, MLP, MoE, Gemma's
extras) and the two checks (`layout_reason`, `graph_unsafe_reason`) that read the same declarations.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_zoo.adapters.base import EXPERT_GATES, ScaledRouter, SparseMoE
from dflash_zoo.cuda.ops.moe import ExpertGate, Routing, ScaledRouting, supported
from dflash_zoo.errors import UnsupportedModelError

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import StaticLayout, TargetAdapter


class MoEParts(NamedTuple):
    """A sparse block's parts (`SparseMoE`), for the routing kernel and the expert kernels (moe.py)."""

    router: nn.Module  # called (x [N, H], *router_args) -> (logits, top-k weights, top-k indices)
    router_args: tuple[Any, ...]
    experts: nn.Module
    shared: nn.Module | None  # an always-on expert, gated per row by sigmoid(shared_gate(x))
    shared_gate: nn.Module | None
    routing: Routing | None  # the router's declared rule (a kernel over `router.weight`); None: the module
    gate: ExpertGate | None  # the experts' declared activation (in the down kernel); None: `_apply_gate`
    # the shared expert's gate, up, down projections and activation, where it has the dense MLPs' names
    shared_mlp: tuple[nn.Linear, nn.Linear, nn.Linear, Callable] | None


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


def norm_eps(norm: nn.Module, default: float | None = None) -> float | None:
    """An RMSNorm module's epsilon: `variance_epsilon` (most HF norms, Gemma 4's from transformers 5.25) or
    `eps` (Gemma 4's before it)."""
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", default))


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
    shared = bool(at.kv_shared is not None and _lookup(adapter, attn, at.kv_shared, aw))
    q, o = (_linear(adapter, attn, n, aw) for n in (at.q_proj, at.o_proj))
    k = v = None
    if not shared:
        k = _linear(adapter, attn, at.k_proj, aw)
        if not (
            at.k_eq_v and _lookup(adapter, attn, at.v_proj, aw) is None
        ):  # k_eq_v: no v_proj, values = keys
            v = _linear(adapter, attn, at.v_proj, aw)
    qk = None
    if at.q_norm is not None:
        qk = (
            _lookup(adapter, attn, at.q_norm, aw),
            None if shared else _lookup(adapter, attn, at.k_norm, aw),
        )
    v_norm = _lookup(adapter, attn, at.v_norm, aw) if at.v_norm is not None and not shared else None
    window = None
    if kind == "sliding_attention":
        window = int(_lookup(adapter, adapter.text_config, layout.sliding_window, "the text config"))
    sinks = _lookup(adapter, attn, at.sinks, aw) if at.sinks is not None else None
    scaling = _lookup(adapter, attn, at.scaling, aw)
    head_dim = int(_lookup(adapter, attn, at.head_dim, aw))
    return dict(q=q, k=k, v=v, o=o, head_dim=head_dim, qk_norm=qk, v_norm=v_norm, kv_source=-1 if shared else None,
                qk_norm_per_head=at.qk_norm_per_head, scaling=scaling, window=window, sinks=sinks,
                output_gate=at.output_gate)  # fmt: skip


def _linear_attention(adapter: TargetAdapter, layout: StaticLayout, layer: nn.Module, where: str) -> dict:
    ln = layout.linear
    gdn = _lookup(adapter, layer, ln.path, where)
    gw = f"{where}.{ln.path}"
    parts = (_lookup(adapter, gdn, ln.conv1d, gw), _lookup(adapter, gdn, ln.norm, gw))
    for name in (ln.a_log, ln.dt_bias):
        _lookup(adapter, gdn, name, gw)
    if not callable(getattr(adapter, "gdn_split", None)):
        raise UnsupportedModelError(
            f"the {_name(adapter)} adapter declares linear-attention layers but no `gdn_split`",
            hint=f"add gdn_split(gdn, in_proj outputs) -> (conv input, z, b, a) to {type(adapter).__module__}",
        )
    projections = tuple(_linear(adapter, gdn, name, gw) for name in ln.in_proj)
    return dict(gdn=gdn, gdn_parts=(*parts, _linear(adapter, gdn, ln.out_proj, gw), projections))


def _layer(adapter: TargetAdapter, layout: StaticLayout, i: int, kind: str, layer: nn.Module) -> LayerModules:
    where = f"layer {i}"
    mixer = dict(q=None, k=None, v=None, o=None, head_dim=None, qk_norm=None, v_norm=None, kv_source=None,
                 qk_norm_per_head=True, scaling=None, window=None, sinks=None, output_gate=False, gdn=None,
                 gdn_parts=None)  # fmt: skip
    if kind == "linear_attention":
        mixer.update(_linear_attention(adapter, layout, layer, where))
    else:
        mixer.update(_attention(adapter, layout, kind, layer, where))
    mlp = _lookup(adapter, layer, layout.mlp_path, where)
    gate = up = down = act = moe_parts = None
    if _is_sparse(layout, mlp):
        moe_parts = _moe_parts(adapter, layout, mlp, f"{where}.{layout.mlp_path}")
    elif layout.mlp is None:
        raise UnsupportedModelError(
            f"{where}'s MLP ({type(mlp).__name__}) has no {layout.moe.experts!r} child, and the static "
            f"layout of the {_name(adapter)} adapter declares no dense MLP",
            hint=f"fix `static_layout` in {type(adapter).__module__}",
        )
    else:
        mw, g = f"{where}.{layout.mlp_path}", layout.mlp
        gate, up, down = (_linear(adapter, mlp, n, mw) for n in (g.gate_proj, g.up_proj, g.down_proj))
        act = _lookup(adapter, mlp, g.act_fn, mw)
    return LayerModules(
        kind=kind,
        input_norm=_lookup(adapter, layer, layout.input_norm, where),
        post_norm=_lookup(adapter, layer, layout.post_attention_norm, where),
        **mixer, mlp=mlp, gate=gate, up=up, down=down, act=act, moe_parts=moe_parts,
        **_extras(adapter, layout, layer, where),
    )  # fmt: skip


def _moe_parts(adapter: TargetAdapter, layout: StaticLayout, block: nn.Module, where: str) -> MoEParts | None:
    """A sparse block's parts, or None where the expert GEMV cannot run its experts (they keep the block's own
    forward)."""
    moe = layout.moe
    experts = _lookup(adapter, block, moe.experts, where)
    if supported(experts) is not None:
        return None
    get = lambda name: None if name is None else _lookup(adapter, block, name, where)  # noqa: E731
    router = get(moe.router)
    routing = gate = None
    if moe.routing is not None:
        if not isinstance(getattr(router, "weight", None), torch.Tensor) or not hasattr(router, "top_k"):
            raise UnsupportedModelError(
                f"{where}.{moe.router} has no weight and top_k for its declared routing"
            )
        renorm = getattr(router, moe.renormalize) if isinstance(moe.renormalize, str) else moe.renormalize
        routing = Routing(moe.routing, int(router.top_k), bool(renorm))
    gate = _expert_gate(adapter, moe.expert_gate, "hidden_act", experts)
    args = tuple(get(a) for a in moe.router_args)
    shared, mlp = get(moe.shared_expert), None
    names = (layout.mlp.gate_proj, layout.mlp.up_proj, layout.mlp.down_proj) if layout.mlp else ()
    if shared is not None and names and all(hasattr(shared, n) for n in names):  # runs as a dense MLP would
        sw = f"{where}.{moe.shared_expert}"
        mlp = (
            *(_linear(adapter, shared, n, sw) for n in names),
            _lookup(adapter, shared, layout.mlp.act_fn, sw),
        )
    return MoEParts(router, args, experts, shared, get(moe.shared_expert_gate), routing, gate, mlp)


def _expert_gate(
    adapter: TargetAdapter, kind: str | None, activation: str, experts: nn.Module
) -> ExpertGate | None:
    """The declared experts' activation for the down kernel, where the config's activation is the one it stands
    for (`EXPERT_GATES`); else None (the module's `_apply_gate` runs)."""
    acts = EXPERT_GATES.get(kind)
    if kind is None or (acts is not None and getattr(adapter.text_config, activation, None) not in acts):
        return None
    if kind == "clamped_swiglu":
        return ExpertGate(kind, float(experts.limit), float(experts.alpha))
    return ExpertGate(kind)


def _extras(adapter: TargetAdapter, layout: StaticLayout, layer: nn.Module, where: str) -> dict:
    """Sandwich norms, a parallel MoE branch, a per-layer input and a layer scalar, where declared."""
    get = lambda name: _lookup(adapter, layer, name, where)  # noqa: E731
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
            out["branch_routing"] = _scaled_routing(
                adapter, pm.routing, out["moe_branch"][0], f"{where}.{pm.router}"
            )
        out["branch_gate"] = _expert_gate(adapter, pm.expert_gate, pm.activation, out["moe_branch"][1])
    pli = layout.per_layer_input
    if pli is not None and getattr(adapter.text_config, pli.width, None):
        out["per_layer"] = tuple(get(n) for n in (pli.gate, pli.projection, pli.norm, pli.act))
    if layout.layer_scalar is not None:
        out["scalar"] = get(layout.layer_scalar)
    return out


def _scaled_routing(adapter: TargetAdapter, r: ScaledRouter, router: nn.Module, where: str) -> ScaledRouting:
    get = lambda name: _lookup(adapter, router, name, where)  # noqa: E731
    norm = get(r.norm)
    if getattr(norm, "weight", None) is not None:
        raise UnsupportedModelError(f"{where}.{r.norm} has a weight; the declared router's norm has none")
    return ScaledRouting(
        eps=float(norm_eps(norm)), scale=get(r.scale), root=float(get(r.scale_root)),
        weight=_linear(adapter, router, r.proj, where).weight, expert_scale=get(r.expert_scale),
        top_k=int(_lookup(adapter, adapter.text_config, r.top_k, "the text config")),
    )  # fmt: skip


def _link_shared_kv(
    adapter: TargetAdapter, layout: StaticLayout, layers: list[LayerModules]
) -> list[LayerModules]:
    """Point each KV-shared layer at the layer of its type that stores K/V for it."""
    at = layout.attention
    if at.kv_shared is None:
        return layers
    store = {}
    for i, (m, layer) in enumerate(zip(layers, adapter.layers(), strict=True)):
        attn = _lookup(adapter, layer, at.path, f"layer {i}")
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
        raise UnsupportedModelError(f"no static layout declared by the {_name(adapter)} adapter")
    text, model = adapter.text_config, adapter.model
    kinds = layer_kinds(adapter)
    layers = [_layer(adapter, layout, i, kinds[i], layer) for i, layer in enumerate(adapter.layers())]
    layers = _link_shared_kv(adapter, layout, layers)
    act = getattr(text, layout.mlp.activation, None) if layout.mlp is not None else None
    return TargetModules(
        layers=layers,
        final_norm=_lookup(adapter, model, adapter.final_norm_path(), "the model"),
        rotary_emb=_lookup(adapter, model, layout.rotary_emb, "the model"),
        eps=_lookup(adapter, text, layout.norm_eps, "the text config"),
        activation=next((kind for kind, acts in EXPERT_GATES.items() if acts and act in acts), None),
        layout=layout,
    )


# ---- whether the fast path can run a target ----------------------------------------------------------------
def layout_reason(adapter: TargetAdapter) -> str | None:
    """Why the static engine cannot run this target's decoder (None: its declared layout covers it)."""
    layout = type(adapter).static_layout
    if layout is None:
        return f"no static layout declared by the {_name(adapter)} adapter"
    other = sorted({t for t in layer_kinds(adapter) if t not in layout.layer_types})
    if other:
        return f"target has {', '.join(other)} layers; the static layout runs {', '.join(layout.layer_types)}"
    return None


def cuda_unverified_reason(adapter: TargetAdapter) -> str | None:
    """Why the static engine should not be this target's default on CUDA although it can run it (None: no
    reason): its layout has not passed the GPU tests yet (`StaticLayout.cuda_verified`)."""
    layout = type(adapter).static_layout
    if layout is not None and not layout.cuda_verified:
        return f"the static layout of the {_name(adapter)} adapter is verified on CPU only, not yet on CUDA"
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
    sparse = []  # a missing module: `resolve` says so
    for layer in adapter.layers():
        mlp = _get(layer, layout.mlp_path)
        if layout.moe is not None and _is_sparse(layout, mlp):
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
