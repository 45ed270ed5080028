"""Sparse MoE blocks for a few rows: the router's rule in one kernel, and the routed experts' projections over
the chosen experts only.

Why: transformers' router is ~6 kernels (linear, softmax, top-k's two, sum, division) and its `grouped_mm`
experts path sorts the (token, expert) pairs, counts tokens per expert, gathers, runs two grouped GEMMs sized
for many rows and scatters back: ~25 kernels a layer. At one row the MoE block of a Qwen3-Coder-30B-A3B shape
took most of a 7.9 ms step for 6.1 GB of weights (docs/performance.md). Here:
- `route`: the declared routing rule (`SparseMoE.routing`) over the router's logits, one program per row;
- `expert_linear`, for the gate/up and the down projection: at one token each (token, expert) pair is one GEMV
  row block that reads only its expert's weights (`expert_gemv`); at several (a verify) one program per
  (expert, output tile) runs every pair routed to its expert on the tensor cores, so each chosen expert is read
  once and the others not at all (`expert_gemm`). The down kernel can compute the declared gated activation
  from the gate/up output itself (`SparseMoE.expert_gate`; else the module's `_apply_gate` runs between them)
  and multiply by the routing weight, writing fp32 [k, rows, H] slices whose in-order sum is the block's output
  (the static engine's `Parts`: the next residual add sums them).
Every op is rounded to the dtype where transformers rounds it (each GEMM output, the bias add, each step of
the activation, the weighted product), so the kernels compute what the modules compute, up to fp32 summation
order. The tile configuration is timed once per shape on CUDA, outside graph capture (`_config`).

The weights are [E, N, K] tensors, or [E, K, N] (`transposed`), as transformers' experts modules hold them;
which modules run here, and how: cuda/static/moe.py. Torch custom ops, so CUDA graphs capture their launches
and `torch.compile` sees one call each; under Triton's interpreter they run on CPU (tests). The kernels
themselves are in moe_kernels.py.
"""

from __future__ import annotations

import functools
import logging

import torch

from dflash_zoo.cuda.ops.gemv import ACTS
from dflash_zoo.cuda.ops.runtime import graph_ms, pow2, tunes

log = logging.getLogger("dflash_zoo")

# (output rows per program, K per iteration, warps): the candidates `_config` times per shape (the first one
# under the interpreter). Each shape of Qwen3-Coder-30B-A3B, gpt-oss-20b (transposed weights too) and
# Qwen3.5-35B-A3B picked one of the first four on an H200; tiles of 64 rows or more lost everywhere
CONFIGS = [(32, 128, 4), (16, 128, 4), (16, 256, 4), (32, 256, 8), (16, 512, 8), (32, 512, 8), (8, 256, 4)]
# several tokens: (output columns per program, K per iteration, warps, pipeline stages) of `expert_gemm`; at 16
# rows on an H200 gpt-oss-20b picked (64, 128, 4, 2), the Qwen MoE shapes (128, 128, 8, 3) and (128, 64, 4, 3)
GROUPED_CONFIGS = [(64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 2), (128, 64, 4, 3), (32, 128, 4, 3),
                   (128, 128, 8, 3), (32, 256, 4, 2)]  # fmt: skip
GATES = {
    None: 0,
    "clamped_swiglu": 2,
    **ACTS,
}  # SparseMoE.expert_gate -> the kernel's ACT (gemv's for SiLU, GELU)
_tuned: dict[tuple, tuple[int, ...]] = {}


@functools.cache
def _kernels():
    from dflash_zoo.cuda.ops import moe_kernels as k  # triton on first use only

    return k.expert_gemv, k.route, k.expert_gemm


@torch.library.custom_op("dflash_zoo::route", mutates_args=())
def route(
    logits: torch.Tensor,
    top_k: int,
    rule: str,
    renormalize: bool,
    expert_scale: torch.Tensor | None = None,
    parts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (top-k weights [N, k] in the logits' dtype, expert ids [N, k], int64), by
    `Routing.rule`: "softmax_topk" or "topk_softmax". With `expert_scale` [E] the weights are then multiplied
    by their experts' scales and stay fp32 (Gemma 4's router); then `parts` may give the logits as their GEMV's
    fp32 partial sums [splits, N, E] (`gemv.gemv_parts`), added and rounded to the scales' dtype first."""
    if rule not in ("softmax_topk", "topk_softmax"):
        raise ValueError(f"unknown routing rule {rule!r}")
    if parts and (expert_scale is None or logits.dim() != 3):
        raise ValueError("partial sums [splits, N, E] of the logits go with expert scales")
    splits = logits.shape[0] if parts else 1
    n, e = logits.shape[-2:]
    if not 0 < top_k <= e:
        raise ValueError(f"top_k {top_k} of {e} experts")
    if expert_scale is not None and expert_scale.shape != (e,):
        raise ValueError(f"expert scales {list(expert_scale.shape)} for {e} experts")
    weights = logits.new_empty(n, top_k, dtype=torch.float32 if expert_scale is not None else logits.dtype)
    index = torch.empty(n, top_k, device=logits.device, dtype=torch.long)
    scale = expert_scale.contiguous() if expert_scale is not None else logits
    _kernels()[1][(n,)](
        logits.contiguous(), scale, weights, index, e, top_k, splits, E=pow2(e), KP=pow2(top_k),
        SOFTMAX_FIRST=rule == "softmax_topk", RENORM=renormalize, SCALED=expert_scale is not None, PARTS=parts,
        num_warps=1 if e <= 256 else 4,
    )  # fmt: skip
    return weights, index


@route.register_fake
def _(logits, top_k, rule, renormalize, expert_scale=None, parts=False):
    n, dtype = logits.shape[-2], torch.float32 if expert_scale is not None else logits.dtype
    return logits.new_empty(n, top_k, dtype=dtype), logits.new_empty(n, top_k, dtype=torch.long)


def _launch(x, weight, bias, experts, transposed, act, limit, alpha, routing, top_k, config) -> torch.Tensor:
    """`expert_linear` with one config: (rows, K tile, warps) runs `expert_gemv` (one row), (columns, K tile,
    warps, stages) `expert_gemm` (several rows)."""
    pairs, tokens = experts.numel(), experts.numel() // top_k
    n, k = (weight.shape[2], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[2])
    s_n, s_k = (weight.stride(2), weight.stride(1)) if transposed else (weight.stride(1), weight.stride(2))
    if routing is not None:
        out = torch.empty(top_k, tokens, n, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(pairs, n, device=x.device, dtype=x.dtype)
    args = (
        x,
        weight,
        bias if bias is not None else out,
        experts,
        routing if routing is not None else out,
        out,
        n,
        k,
    )
    flags = dict(BIAS=bias is not None, ACT=act, WEIGHTED=routing is not None, num_warps=config[2])
    if len(config) == 3:
        _kernels()[0][(pairs, -(-n // config[0]))](
            *args, pairs // x.shape[0], x.stride(0), weight.stride(0), s_n, s_k, top_k, limit, alpha,
            BN=config[0], BK=config[1], **flags,
        )  # fmt: skip
    else:  # every expert's program starts; those no pair chose return at once
        _kernels()[2][(weight.shape[0], -(-n // config[0]))](
            *args, pairs, pairs // x.shape[0], x.stride(0), weight.stride(0), s_n, s_k, top_k, limit, alpha,
            R=pow2(tokens), SP=pow2(pairs), BN=config[0], BK=config[1], IEEE=x.dtype == torch.float32,
            num_stages=config[3], **flags,
        )  # fmt: skip
    return out


def _config(x, weight, bias, experts, transposed, act, limit, alpha, routing, top_k, tune) -> tuple[int, ...]:
    """The fastest of CONFIGS (one token) or GROUPED_CONFIGS (several) for this shape, timed once on CUDA: each
    call after a 128 MB write, so that the weights come from HBM as in a step, with each token's experts
    drawn at random (distinct within a token); the first one where `runtime.tunes` says no."""
    tokens = experts.numel() // top_k
    configs = CONFIGS if tokens == 1 else GROUPED_CONFIGS
    key = (
        tuple(weight.shape),
        weight.dtype,
        transposed,
        act,
        routing is not None,
        experts.numel(),
        tokens,
        x.device,
    )
    if key in _tuned:
        return _tuned[key]
    if not tunes(x, tune):
        return configs[0]

    gen = torch.Generator().manual_seed(0)
    drawn = torch.stack([torch.randperm(weight.shape[0], generator=gen)[:top_k] for _ in range(tokens)])
    drawn = drawn.reshape(-1).to(x.device)
    flush = torch.empty(2**25, device=x.device, dtype=torch.float32)
    base = graph_ms(flush.zero_)
    run = functools.partial(_launch, x, weight, bias, drawn, transposed, act, limit, alpha, routing, top_k)
    times = {c: graph_ms(lambda c=c: (flush.zero_(), run(c))) - base for c in configs}
    _tuned[key] = best = min(times, key=times.get)
    log.debug("expert linear %s: %s (%.1f us)", key[:7], best, times[best] * 1e3)
    return best


def tuned_configs() -> dict[str, list[int]]:
    """The configs timed so far, by pairs, weight shape and kernel ("8x[128, 1536, 2048]+act1+weighted")."""
    return {
        f"{pairs}x{list(shape)}{'T' if t else ''}{f'+act{act}' if act else ''}{'+weighted' if w else ''}": list(
            c
        )
        for (shape, _, t, act, w, pairs, _, _), c in _tuned.items()
    }


@torch.library.custom_op("dflash_zoo::expert_linear", mutates_args=())
def expert_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    experts: torch.Tensor,
    transposed: bool,
    top_k: int,
    act: int = 0,
    limit: float = 0.0,
    alpha: float = 0.0,
    routing: torch.Tensor | None = None,
    tune: bool = True,
) -> torch.Tensor:
    """x [R, K] (act 1 to 3: [R, 2K], a gate/up output whose activation is the input, `GATES`); weight [E, N, K]
    ([E, K, N] when `transposed`); bias [E, N]; experts [S]: each token's top_k experts in turn (distinct within
    a token), S a multiple of R (pair s reads row s // (S / R)) -> [S, N]: pair s's row through its expert's
    projection. With `routing` [S], the outputs times their weights, in fp32 slices [top_k, S / top_k, N]
    (slice j: every token's j-th expert) whose sum over slices is the weighted sum. `tune`: time the configs
    (`runtime.tunes`), else take the first."""
    if top_k < 1 or experts.numel() % top_k or experts.numel() % x.shape[0]:
        raise ValueError(
            f"{experts.numel()} pairs are not top_k={top_k} per token over {x.shape[0]} input rows"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    experts = experts.contiguous()
    routing = routing.contiguous() if routing is not None else None
    config = _config(x, weight, bias, experts, transposed, act, limit, alpha, routing, top_k, tune)
    return _launch(x, weight, bias, experts, transposed, act, limit, alpha, routing, top_k, config)


@expert_linear.register_fake
def _(x, weight, bias, experts, transposed, top_k, act=0, limit=0.0, alpha=0.0, routing=None, tune=True):
    n = weight.shape[2] if transposed else weight.shape[1]
    if routing is not None:
        return x.new_empty(top_k, experts.numel() // top_k, n, dtype=torch.float32)
    return x.new_empty(experts.numel(), n)
