"""The sparse MoE parts of a target's `StaticLayout` resolved against its modules: a sparse block's router,
experts and shared expert (`SparseMoE`), the declared routing rule and expert activation, and Gemma 4's router
parts (`ScaledRouter`), for the routing and expert kernels (cuda/ops/moe.py, run by cuda/static/moe.py).

The experts' weight layouts are the ones transformers' experts decorator declares on the module
(`integrations/moe.py`: `is_transposed`, `has_bias`, `has_gate`); a module without them, or with a post-expert
norm, keeps its own forward (`experts_reason`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from dflash_zoo.adapters.base import EXPERT_GATES, ScaledRouter
from dflash_zoo.cuda.static.lookup import lookup, lookup_linear, norm_eps
from dflash_zoo.errors import UnsupportedModelError

if TYPE_CHECKING:
    from dflash_zoo.adapters.base import StaticLayout, TargetAdapter


@dataclass(frozen=True)
class Routing:
    """A router's declared rule (`SparseMoE.routing`), resolved against its module."""

    rule: str  # "softmax_topk" or "topk_softmax"
    top_k: int
    renormalize: bool  # softmax_topk: the top-k weights divided by their sum


@dataclass(frozen=True)
class ScaledRouting:
    """A declared `ScaledRouter` (Gemma 4) resolved against its module: its parameters, constants and top k."""

    eps: float  # the weightless norm's
    scale: torch.Tensor  # [H]
    root: float  # H^-1/2
    weight: torch.Tensor  # [E, H], the projection's
    expert_scale: torch.Tensor  # [E]
    top_k: int


@dataclass(frozen=True)
class ExpertGate:
    """The declared gated activation (`SparseMoE.expert_gate`) with the module's constants."""

    kind: str  # "silu", "clamped_swiglu" or "gelu_tanh"
    limit: float = 0.0
    alpha: float = 0.0


def experts_reason(experts: nn.Module) -> str | None:
    """None when the expert kernels (`moe.routed`) can run this experts module, else why not."""
    flags = ("is_transposed", "has_bias", "has_gate")
    if not all(hasattr(experts, f) for f in flags) or not hasattr(experts, "gate_up_proj"):
        return f"{type(experts).__name__} declares no transformers experts layout"
    if getattr(experts, "has_post_expert_norm", False):
        return f"{type(experts).__name__} has a post-expert norm"
    if not experts.has_gate:
        return f"{type(experts).__name__} has no gate projection"
    return None


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


def resolve_moe(
    adapter: TargetAdapter, layout: StaticLayout, block: nn.Module, where: str
) -> MoEParts | None:
    """A sparse block's parts, or None where the expert GEMV cannot run its experts (they keep the block's own
    forward)."""
    moe = layout.moe
    experts = lookup(adapter, block, moe.experts, where)
    if experts_reason(experts) is not None:
        return None
    get = lambda name: None if name is None else lookup(adapter, block, name, where)  # noqa: E731
    router = get(moe.router)
    routing = gate = None
    if moe.routing is not None:
        if not isinstance(getattr(router, "weight", None), torch.Tensor) or not hasattr(router, "top_k"):
            raise UnsupportedModelError(
                f"{where}.{moe.router} has no weight and top_k for its declared routing"
            )
        renorm = getattr(router, moe.renormalize) if isinstance(moe.renormalize, str) else moe.renormalize
        routing = Routing(moe.routing, int(router.top_k), bool(renorm))
    gate = resolve_expert_gate(adapter, moe.expert_gate, "hidden_act", experts)
    args = tuple(get(a) for a in moe.router_args)
    shared, mlp = get(moe.shared_expert), None
    names = (layout.mlp.gate_proj, layout.mlp.up_proj, layout.mlp.down_proj) if layout.mlp else ()
    if shared is not None and names and all(hasattr(shared, n) for n in names):  # runs as a dense MLP would
        sw = f"{where}.{moe.shared_expert}"
        mlp = (
            *(lookup_linear(adapter, shared, n, sw) for n in names),
            lookup(adapter, shared, layout.mlp.act_fn, sw),
        )
    return MoEParts(router, args, experts, shared, get(moe.shared_expert_gate), routing, gate, mlp)


def resolve_expert_gate(
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


def resolve_scaled_routing(
    adapter: TargetAdapter, r: ScaledRouter, router: nn.Module, where: str
) -> ScaledRouting:
    get = lambda name: lookup(adapter, router, name, where)  # noqa: E731
    norm = get(r.norm)
    if getattr(norm, "weight", None) is not None:
        raise UnsupportedModelError(f"{where}.{r.norm} has a weight; the declared router's norm has none")
    return ScaledRouting(
        eps=float(norm_eps(norm)), scale=get(r.scale), root=float(get(r.scale_root)),
        weight=lookup_linear(adapter, router, r.proj, where).weight, expert_scale=get(r.expert_scale),
        top_k=int(lookup(adapter, adapter.text_config, r.top_k, "the text config")),
    )  # fmt: skip
