"""Sparse MoE blocks of the static target, run as their declared parts (layout_moe.py) over the kernels of
cuda/ops/moe.py: the routing rule's kernel over the router's logits, and for steps of at most `moe_rows` rows
the routed experts through the expert kernels (`routed_parts`); longer steps call the experts module. A shared
expert with the dense MLPs' names runs as a gated MLP whose gate/up GEMM also yields its one-logit gate and the
router's logits, where those are plain projections of the same input (`MoEBlocks`).

The experts' outputs come back as fp32 slices [k, N, H], one per routing slot, whose in-order sum rounded to
the dtype is the module's output (`Parts`: the next residual add sums them in its own kernel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_zoo.cuda.ops import fused
from dflash_zoo.cuda.ops import gemv as gemv_ops
from dflash_zoo.cuda.ops.moe import GATES, expert_linear, route
from dflash_zoo.cuda.static.layout import LayerModules
from dflash_zoo.cuda.static.layout_moe import ExpertGate, MoEParts, ScaledRouting, experts_reason
from dflash_zoo.cuda.static.linear import FusedLinear, Gemv, Parts, linear, summed
from dflash_zoo.cuda.static.mlp import MLPKernels, swiglu_down


def routed_parts(
    experts: Any, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate: ExpertGate | None = None,
    tune: bool = True,
) -> torch.Tensor:  # fmt: skip
    """`experts(x, index, weights)` as fp32 slices [k, N, H] (x [N, H], index / weights [N, k]), each the
    outputs of one expert per row times its routing weight, rounded as transformers rounds that product: their
    in-order sum, rounded to the dtype, is the module's output. `gate`: the activation computed in the down
    kernel (else the module's `_apply_gate` runs between the projections); `tune`: time the kernels' configs."""
    k = index.shape[1]
    pairs = index.reshape(-1)  # [N * k]: token t's experts at t * k ...
    up_bias = experts.gate_up_proj_bias if experts.has_bias else None
    h = expert_linear(
        x, experts.gate_up_proj, up_bias, pairs, experts.is_transposed, k, tune=tune
    )  # [N*k, 2I]
    act = GATES[gate.kind if gate else None]
    limit, alpha = (gate.limit, gate.alpha) if gate else (0.0, 0.0)
    if not act:
        h = experts._apply_gate(h)  # [N * k, I]: the family's activation over its gate / up layout
    down_bias = experts.down_proj_bias if experts.has_bias else None
    return expert_linear(
        h, experts.down_proj, down_bias, pairs, experts.is_transposed, k, act, limit, alpha, weights.reshape(-1),
        tune,
    )  # fmt: skip  # [k, N, H]


def routed(
    experts: Any, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate: ExpertGate | None = None
) -> torch.Tensor:
    """What `experts(x, index, weights)` returns, through `expert_linear`: x [N, H], index / weights [N, k]."""
    return routed_parts(experts, x, index, weights, gate).sum(0).to(x.dtype)


def _logit(gate: nn.Module | None, like: nn.Linear) -> list[nn.Linear]:
    """[gate] where a shared expert's gate is a plain one-output linear with a bias where its gate/up projection
    `like` has one (fused beside them), else []."""
    ok = isinstance(gate, nn.Linear) and gate.out_features == 1
    return [gate] if ok and (gate.bias is None) == (like.bias is None) else []


def _router(p: MoEParts, moe_rows: int) -> list[nn.Module]:
    """[router] where a declared routing rule's kernel reads its logits (`MoEBlocks.route`) from an [E, H]
    weight, fused beside the shared expert's bias-free gate/up (the same input), else []."""
    weight = getattr(p.router, "weight", None)
    ok = p.routing is not None and moe_rows and isinstance(weight, torch.Tensor) and weight.dim() == 2
    no_bias = getattr(p.router, "bias", None) is None and p.shared_mlp[0].bias is None
    return [p.router] if ok and no_bias else []


class MoEBlocks:
    """The sparse MoE blocks (and parallel expert branches) of a static target's layers.

    Args: the target's layers; `fuse`, `gemv` and `mlp` as the target's dense MLPs; `moe_rows`: steps of at
    most this many rows run the routed experts through the expert kernels (0: never).
    """

    def __init__(self, layers: list[LayerModules], fuse: bool, gemv: Gemv, mlp: MLPKernels, moe_rows: int):
        self.layers, self.gemv, self.mlp, self.moe_rows = layers, gemv, mlp, moe_rows
        # a shared expert with dense projection names: fused like a dense MLP, with its one-logit gate (where that
        # is a plain linear, `shared`) and its router's logits (`route`) as further outputs
        self.shared_gate_up: list[FusedLinear | None] = [None] * len(layers)
        self.shared_extra: list[tuple[bool, bool]] = [(False, False)] * len(layers)  # (logit, router) fused
        for i, p in enumerate(m.moe_parts for m in layers):
            if p is not None and p.shared_mlp:
                logit, router = _logit(p.shared_gate, p.shared_mlp[0]), _router(p, moe_rows)
                self.shared_gate_up[i] = FusedLinear([*p.shared_mlp[:2], *logit, *router], fuse, gemv)
                self.shared_extra[i] = (bool(logit), bool(router))

    def experts(self, experts, x, index, weights, gate=None) -> torch.Tensor | Parts:
        """Routed experts of rows x [N, H]: the MoE kernels for few rows (their weighted slices, `Parts`), else
        the module (its implementation)."""
        if x.shape[0] <= self.moe_rows and experts_reason(experts) is None:
            return Parts(routed_parts(experts, x, index, weights, gate, self.gemv.tune), None)
        return experts(x, index, weights)

    def route(self, p: MoEParts, x, logits=None):
        """(top-k weights, expert ids) [N, k] of rows x [N, H]: the declared rule's kernel over the router's
        logits (`logits` [N, E] where already projected) where the MoE kernels run, else the router module."""
        if p.routing is None or not self.moe_rows:
            return p.router(x, *p.router_args)[1:]
        if logits is None:
            logits = linear(x, p.router.weight, getattr(p.router, "bias", None), self.gemv)  # [N, E]
        return route(logits, p.routing.top_k, p.routing.rule, p.routing.renormalize)

    def sparse(self, i: int, x, fold: bool):
        """A sparse MoE block over x [1, T, H]: as its module, or as its declared parts (the routed experts of
        a step of at most `moe_rows` rows as `Parts` with `fold`, the layer's `fold_down`)."""
        m, p = self.layers[i], self.layers[i].moe_parts
        if p is None or (x.shape[1] > self.moe_rows and p.routing is None):
            out = m.mlp(x)  # [1, T, H]; some MoE blocks also return their router scores
            return out[0] if isinstance(out, tuple) else out
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        # the shared expert's gate/up (with its gate's logit and the router's logits where fused): one GEMV
        shared_in = self.shared_gate_up[i](flat) if self.shared_gate_up[i] is not None else None
        logits = shared_in[-1] if self.shared_extra[i][1] else None
        weights, index = self.route(p, flat, logits)  # [T, k] each
        out = self.experts(p.experts, flat, index, weights, p.gate)
        fold = isinstance(out, Parts) and fold
        shared = self.shared(i, flat, shared_in, fold) if p.shared is not None else None
        if fold and not isinstance(
            shared, torch.Tensor
        ):  # summed into the residual by the next norm's kernel
            return out if shared is None else Parts(out.sums, None, shared.sums)
        out = summed(out, flat)
        return (out if shared is None else out + shared).reshape(x.shape)

    def shared_folds(self, i: int) -> bool:
        """Whether layer i's shared expert runs as a gated down GEMV's `Parts` in a one-row step: SwiGLU with
        dense names, its gate an output of the fused projection, no down bias."""
        p = self.layers[i].moe_parts
        silu = self.mlp.gate_act == gemv_ops.ACTS["silu"]
        fused_logit = self.shared_extra[i][0]
        return self.shared_gate_up[i] is not None and fused_logit and silu and p.shared_mlp[2].bias is None

    def shared(self, i: int, x, projected, fold: bool) -> torch.Tensor | Parts:
        """The always-on expert over rows x [N, H], gated per row: sigmoid(shared_gate(x)) * shared(x); for one
        row with `fold`, as `Parts` (the gate applied in the down kernel). `projected`: the outputs of its fused
        gate/up (None: no fused projection)."""
        p = self.layers[i].moe_parts
        if projected is None:
            return torch.sigmoid(p.shared_gate(x)) * p.shared(x)
        gate, up = projected[:2]  # [N, F] each; then the gate's logit [N, 1] where fused
        logit = projected[2] if self.shared_extra[i][0] else p.shared_gate(x)
        down, act = p.shared_mlp[2:]
        # `fold` (the layer's `fold_down`) implies `shared_folds(i)`; gemv_parts' shape is tuned at run time: not
        # traceable
        if fold and x.shape[0] == 1 and not torch.compiler.is_compiling():
            return Parts(gemv_ops.gemv_parts(up, down.weight, gate, logit, tune=self.gemv.tune), None)
        return torch.sigmoid(logit) * swiglu_down(self.mlp, gate, up, down, act)

    def branch_route(self, r: ScaledRouting | None, router: nn.Module, x):
        """(top-k weights, expert ids) [N, k] of a parallel branch's rows x [N, H]: its declared router's parts
        through the kernels where the MoE kernels run (a norm, the projection, the routing rule), else the
        module."""
        if r is None or not self.moe_rows:
            return router(x)[1:]
        return self.scaled_route(r, fused.rms_norm(x, r.scale, r.eps, post=r.root))

    def scaled_route(self, r: ScaledRouting, h):
        """(top-k weights, expert ids) [N, k] from a declared router's input h [N, H] (norm(x) * scale * root);
        one row through the GEMV kernels: the routing kernel adds the GEMV's partial sums itself."""
        if self.gemv.on and h.shape[0] == 1 and not torch.compiler.is_compiling():
            sums = gemv_ops.gemv_parts(h, r.weight, None, tune=self.gemv.tune)  # [S, 1, E]
            return route(sums, r.top_k, "softmax_topk", True, r.expert_scale, parts=True)
        logits = linear(h, r.weight, None, self.gemv)  # [N, E]
        return route(logits, r.top_k, "softmax_topk", True, r.expert_scale)
