"""The drafter's attention alone in a training step: dense mask vs block-sparse flex, same shapes and mask.

Per repeat, one `Attend` is built (its block masks included, as in a step) and called once per drafter layer
with random q / k / v of the step's shapes: [rows, heads, n*B, head_dim] queries, T context and n*B block
keys. On CUDA the forward and the backward are timed (CUDA events); elsewhere, where flex attention has no
backward, the forward only. The median over repeats is reported, after as many unmeasured warm-up calls
(flex compiles on its first).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from dflash_zoo.training.attention import Attend
from dflash_zoo.training.blocks import make_batch, make_blocks, sample_anchors


def _step_span(tr: Any) -> tuple[Any, int, int]:
    """(the training Span of the trainer's first batch, rows, context length), anchors from a private RNG."""
    gen = torch.Generator().manual_seed(0)
    exs = [tr.shard[i] for i in tr.batch(0)]
    b = tr.dcfg.block_size
    anchors = [sample_anchors(len(ex.ids), ex.start, b, tr.cfg.anchors_per_seq, False, gen) for ex in exs]
    batch = make_batch([list(ex.ids) for ex in exs], anchors, tr.device)
    return make_blocks(batch, b, tr.dcfg.mask_token_id, tr.weights)[3], len(exs), batch.ids.shape[1]


def _inputs(tr: Any, rows: int, n: int, ctx: int, grad: bool) -> list[torch.Tensor]:
    cfg = tr.dcfg
    dtype = torch.bfloat16 if tr.device.type == "cuda" else torch.float32
    shapes = [(rows, cfg.num_attention_heads, n, cfg.head_dim)]
    shapes += [(rows, cfg.num_key_value_heads, ctx, cfg.head_dim)] * 2
    shapes += [(rows, cfg.num_key_value_heads, n, cfg.head_dim)] * 2
    return [torch.randn(s, device=tr.device, dtype=dtype, requires_grad=grad) for s in shapes]


def _once(kind: str, span: Any, rows: int, xs: list[torch.Tensor], layers: list[Any], grad: bool) -> None:
    att = Attend(span, rows, kind)
    with torch.set_grad_enabled(grad):
        out = sum(att(*xs, a.causal, a.window).float().sum() for a in layers)
        if grad:
            out.backward()


def attention_times(tr: Any, opts: Any) -> dict[str, Any]:
    """Median seconds per step of the drafter's attention (all its layers), dense and flex."""
    grad = tr.device.type == "cuda"
    span, rows, ctx = _step_span(tr)
    xs = _inputs(tr, rows, span.q_pos.shape[-1], ctx, grad)
    layers = [layer.self_attn for layer in tr.raw.layers]
    times: dict[str, float] = {}
    for kind in ("dense", "flex"):
        runs = []
        for i in range(2 * max(1, opts.steps)):
            t0 = time.perf_counter()
            _once(kind, span, rows, xs, layers, grad)
            if grad:
                torch.cuda.synchronize(tr.device)
            if i >= max(1, opts.steps):  # the first half warms up (and compiles)
                runs.append(time.perf_counter() - t0)
        times[kind] = statistics.median(runs)
    return {
        "mode": "forward+backward" if grad else "forward",
        "dense_seconds": times["dense"],
        "flex_seconds": times["flex"],
        "flex_speedup": times["dense"] / times["flex"],
    }
