"""A sandwich-norm layer's residual adds (Gemma 4) in the static target, each with its norms in one kernel
(`ops.sandwich.sandwich_add`): after the attention sublayer (its output norm, the residual add, the MLP's and
the experts' input norms, the router's input) and after the MLP (the dense and routed outputs' norms, their
sum, the outer norm, the residual add, the layer scalar, the next layer's input norm).

The functions read the target's resolved layers and norms (`StaticTarget`): `runs` says which layers take the
kernel, `after_attention` and `after_mlp` run it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dflash_zoo.cuda.ops.sandwich import sandwich_add
from dflash_zoo.cuda.static.linear import Parts, summed
from dflash_zoo.cuda.static.lookup import norm_eps

if TYPE_CHECKING:
    from dflash_zoo.cuda.static.target import StaticTarget


def runs(target: StaticTarget, i: int) -> bool:
    """Whether layer i of a `StaticTarget` runs its residual adds through `sandwich_add` (`after_attention`,
    `after_mlp`): the kernels are on, its sublayer outputs are normed (sandwich norms), no per-layer input sits
    between the MLP and the next layer, and every norm involved (the next layer's input norm too) has a weight
    of the step's dtype and the model's epsilon; a parallel MoE branch needs its router's declared parts."""
    m, norm = target.layers[i], target.norm
    if not norm.kernel or m.attn_out_norm is None or m.mlp_out_norm is None or m.per_layer is not None:
        return False
    nxt = target.layers[i + 1].input_norm if i + 1 < len(target.layers) else target.final_norm
    mods = [m.attn_out_norm, m.post_norm, m.mlp_out_norm, nxt]
    if m.moe_branch is not None:
        if m.branch_routing is None or m.branch_routing.eps != norm.eps or not target.moe_rows:
            return False
        mods += list(m.moe_branch[2:])  # the dense output's, the experts' input and output norms
    eps = [norm_eps(n) for n in mods]
    return all(norm.fuses(n, target.dtype) for n in mods) and all(e == norm.eps for e in eps)


def _as_delta(out: Any, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(a sublayer's output for the kernel, whether it is partial sums): `Parts` without a bias or a second
    group as their sums, anything else as a tensor shaped like the residual."""
    if isinstance(out, Parts) and out.bias is None and out.more is None:
        return out.sums, True
    return summed(out, like).reshape(like.shape), False


def after_attention(
    target: StaticTarget, i: int, x: torch.Tensor, h: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Residual x [1, T, H] plus the attention output h normed -> (that sum, [the MLP's input; with a parallel
    branch also the experts' input and the router's input]), each [1, T, H]."""
    m, norm = target.layers[i], target.norm
    weights = [m.post_norm.weight]
    r = m.branch_routing
    if (
        m.moe_branch is not None
    ):  # the experts' input norm, and the router's input: a weightless norm x scales
        weights += [m.moe_branch[3].weight, r.scale]
    d, parts = _as_delta(h, x)
    x, normed = sandwich_add(
        x, d, m.attn_out_norm.weight, weights, norm.eps, norm.fp32, norm.offset, parts,
        last_llama=m.moe_branch is not None, post=r.root if r is not None else 1.0,
    )  # fmt: skip
    return x, list(normed)


def after_mlp(
    target: StaticTarget, i: int, x: torch.Tensor, dense: Any, routed: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual x [1, T, H] plus the MLP's outputs (the dense one; `routed` the parallel experts', or None),
    normed and summed as the layer declares, times the layer scalar -> (the layer's output, the next layer's
    input norm of it (the final norm after the last layer))."""
    m, norm = target.layers[i], target.norm
    nxt = target.layers[i + 1].input_norm if i + 1 < len(target.layers) else target.final_norm
    d1, parts1 = _as_delta(dense, x)
    branch = {}
    if routed is not None:  # norm_o(norm_1(dense) + norm_2(experts))
        d2, parts2 = _as_delta(routed, x)
        branch = dict(d2=d2, w2=m.moe_branch[4].weight, parts2=parts2, outer=m.mlp_out_norm.weight)
    w1 = m.moe_branch[2].weight if routed is not None else m.mlp_out_norm.weight
    x, normed = sandwich_add(
        x, d1, w1, [nxt.weight], norm.eps, norm.fp32, norm.offset, parts1, scalar=m.scalar, **branch
    )  # fmt: skip
    return x, normed[0]
