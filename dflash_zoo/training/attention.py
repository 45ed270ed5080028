"""Drafter attention for training: the dense reference and a block-sparse FlexAttention path.

Key layout of one training call (row r of the batch): `[context 0..C-1 | padding up to Cp | blocks 0..N-1]`,
with C the padded sequence length, Cp = C rounded up to the flex tile (so the blocks start on a tile) and
N = n*B block slots. The visibility rule is exactly `engine.drafter.Span.mask`:
- a query sees context key c when c < its `q_limit` (the block's anchor; no limit: every context key),
  and q_pos - c < window on a sliding layer;
- it sees block key j when j is in its own block (`q_segment`), j's position <= its own on a causal layer,
  and |q_pos - pos(j)| < window on a sliding layer (only q_pos - pos(j) when causal);
- padding keys (C..Cp-1) are never visible.

`visible` evaluates the rule on index tensors: element by element inside the flex kernel (`mask_mod`) and
broadcast over whole tiles when the block mask is built (`block_mask`), so the kernel and the tile map never
disagree. Only tiles holding a visible entry are computed; tiles wholly visible skip the rule.

`dense` runs the engine's own rule (`Span.mask` + SDPA over `[context | blocks]`), the reference. Flex runs
compiled on CUDA (uncompiled it materialises the scores). PyTorch's flex attention has no backward on CPU
(torch 2.13): there `auto` picks dense, and flex serves forward-only checks.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dflash_zoo.engine.drafter import Span
from dflash_zoo.errors import InvalidArgumentError

TILE = 128  # flex tile (queries x keys); the block keys start on a tile boundary
KINDS = ("auto", "dense", "flex")
_CHUNK_ELEMENTS = 1 << 26  # mask entries evaluated at once while building a block mask


def resolve_kind(kind: str, device: torch.device | str, grad: bool = True) -> str:
    """`auto` -> flex on CUDA, dense elsewhere; flex where it cannot run is an error naming why."""
    if kind not in KINDS:
        raise InvalidArgumentError(f"unknown attention {kind!r}; use one of {', '.join(KINDS)}")
    dev = torch.device(device).type
    if kind == "auto":
        return "flex" if dev == "cuda" else "dense"
    if kind == "flex" and grad and dev != "cuda":
        raise InvalidArgumentError(
            f"flex attention has no backward pass on {dev} in this torch ({torch.__version__})",
            hint="use --attention dense (or auto) off CUDA",
        )
    return kind


@dataclass(frozen=True)
class Layout:
    """Per-row index tensors of one training call, in the padded key layout (module docstring).

    q_pos, q_limit, q_segment: [R, N]; ctx_pos: [Cp] (padding positions repeat the last real one).
    """

    q_pos: torch.Tensor
    q_limit: torch.Tensor | None
    q_segment: torch.Tensor | None
    ctx_pos: torch.Tensor
    ctx_len: int  # C: real (padded-batch) context keys
    ctx_pad: int  # Cp: context keys incl. the tile padding
    bounds: (
        torch.Tensor
    )  # [2] (C, Cp) on the device: the rule reads these, so a new length recompiles nothing

    @property
    def rows(self) -> int:
        return self.q_pos.shape[0]

    @property
    def q_len(self) -> int:
        return self.q_pos.shape[1]

    @property
    def kv_len(self) -> int:
        return self.ctx_pad + self.q_len


def layout(span: Span, rows: int) -> Layout:
    """The padded layout of `span` for `rows` batch rows (1-D span fields are shared by every row)."""
    n = span.q_pos.shape[-1]
    c = len(span.ctx_pos)
    cp = -(-c // TILE) * TILE

    def per_row(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.expand(rows, n).contiguous() if t.dim() == 1 else t

    if c == 0:
        raise ValueError("a training call needs at least one context position")
    ctx_pos = torch.cat([span.ctx_pos, span.ctx_pos[-1:].expand(cp - c)])  # [Cp]
    bounds = torch.tensor([c, cp], device=ctx_pos.device)
    return Layout(per_row(span.q_pos), per_row(span.q_limit), per_row(span.q_segment), ctx_pos, c, cp, bounds)


def visible(lay: Layout, causal: bool, window: int | None) -> Callable:
    """mask_mod(b, h, q, kv) -> bool: whether query q of row b sees key kv (module docstring's rule)."""

    def mask_mod(b, h, q, kv):
        qp = lay.q_pos[b, q]
        ctx_len, ctx_pad = lay.bounds[0], lay.bounds[1]
        in_ctx = kv < ctx_pad
        c = torch.minimum(kv, ctx_pad - 1)  # context key (clamped: unused for block keys)
        ctx_ok = c < ctx_len
        if lay.q_limit is not None:
            ctx_ok = ctx_ok & (c < lay.q_limit[b, q])
        j = torch.clamp(kv - ctx_pad, min=0)  # block slot of a block key
        blk_ok = ~in_ctx
        if lay.q_segment is not None:
            blk_ok = blk_ok & (lay.q_segment[b, q] == lay.q_segment[b, j])
        kp = lay.q_pos[b, j]
        if causal:
            blk_ok = blk_ok & (kp <= qp)
        if window is not None:  # HF windows include the current token: distance < window
            ctx_ok = ctx_ok & (qp - lay.ctx_pos[c] < window)
            blk_ok = blk_ok & (qp - kp < window)
            if not causal:  # a bidirectional window reaches as far ahead as behind
                blk_ok = blk_ok & (kp - qp < window)
        return torch.where(in_ctx, ctx_ok, blk_ok)

    return mask_mod


def dense_mask(lay: Layout, causal: bool, window: int | None) -> torch.Tensor:
    """[R, N, Cp + N] boolean: `visible` evaluated everywhere (tests; small shapes only)."""
    dev = lay.q_pos.device
    b = torch.arange(lay.rows, device=dev)[:, None, None]
    q = torch.arange(lay.q_len, device=dev)[None, :, None]
    kv = torch.arange(lay.kv_len, device=dev)[None, None, :]
    return visible(lay, causal, window)(b, None, q, kv).expand(lay.rows, lay.q_len, lay.kv_len)


def _tiles(lay: Layout, mod: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) [R, 1, nq, nk] booleans: tiles holding some / only visible entries."""
    dev, rows, qn, kvn = lay.q_pos.device, lay.rows, lay.q_len, lay.kv_len
    nq, nk = -(-qn // TILE), -(-kvn // TILE)
    counts = torch.zeros(rows, nq, nk, dtype=torch.int32, device=dev)
    kv = torch.arange(nk * TILE, device=dev)
    b = torch.arange(rows, device=dev)[:, None, None]
    step = max(1, _CHUNK_ELEMENTS // (rows * nk * TILE * TILE)) * TILE  # query rows per chunk
    for start in range(0, nq * TILE, step):
        q = torch.arange(start, min(start + step, nq * TILE), device=dev)
        ok = mod(b, None, q.clamp(max=qn - 1)[None, :, None], kv.clamp(max=kvn - 1)[None, None, :])
        ok = (
            ok & (q < qn)[None, :, None] & (kv < kvn)[None, None, :]
        )  # [R, qc, nk*TILE]; out of range: hidden
        t = ok.view(rows, -1, TILE, nk, TILE).sum((2, 4), dtype=torch.int32)  # [R, qc/TILE, nk]
        counts[:, start // TILE : start // TILE + t.shape[1]] = t
    full = counts == TILE * TILE
    return ((counts > 0) & ~full)[:, None], full[:, None]


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, 1, nq, nk] booleans -> (count [R, 1, nq], indices [R, 1, nq, nk] with the set tiles first)."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return count, order.to(torch.int32)


def block_mask(lay: Layout, causal: bool, window: int | None) -> Any:
    """The flex `BlockMask` of one (causal, window) kind of layer."""
    from torch.nn.attention.flex_attention import BlockMask

    mod = visible(lay, causal, window)
    partial, full = _tiles(lay, mod)
    (pn, pi), (fn, fi) = _ordered(partial), _ordered(full)
    return BlockMask.from_kv_blocks(
        pn, pi, fn, fi, BLOCK_SIZE=TILE, mask_mod=mod, seq_lengths=(lay.q_len, lay.kv_len)
    )


@functools.cache
def _flex(compiled: bool) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


def _common_dtype(q: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """What SDPA would compute in: the autocast dtype when autocast is on, else the value dtype."""
    dev = q.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else v.dtype


class Attend:
    """Attention of every drafter layer of one training call; block masks are built once per layer kind."""

    def __init__(self, span: Span, rows: int, kind: str):
        self.span, self.kind = span, kind
        self.lay = layout(span, rows) if kind == "flex" else None
        self._masks: dict[tuple[bool, int | None], Any] = {}

    def __call__(self, q, k_ctx, v_ctx, k_blk, v_blk, causal: bool, window: int | None) -> torch.Tensor:
        """q [R, h, N, d]; k/v_ctx [R, kvh, C, d]; k/v_blk [R, kvh, N, d] -> [R, h, N, d]."""
        gqa = q.shape[1] != k_blk.shape[1]
        if self.kind == "dense":  # the engine's rule and kernel: the reference
            mask = self.span.mask(causal, window)
            k, v = torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2)
            attn_mask = None if mask is None else mask.unsqueeze(-3)  # [1 or R, 1, N, C + N]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        return self._flex(q, k_ctx, v_ctx, k_blk, v_blk, causal, window, gqa)

    def _flex(self, q, k_ctx, v_ctx, k_blk, v_blk, causal, window, gqa) -> torch.Tensor:
        lay = self.lay
        dt = _common_dtype(q, v_blk)
        pad = k_ctx.new_zeros(*k_ctx.shape[:2], lay.ctx_pad - lay.ctx_len, k_ctx.shape[-1])
        k = torch.cat([k_ctx, pad, k_blk], 2).to(dt)  # [R, kvh, Cp + N, d]
        v = torch.cat([v_ctx, pad.to(v_ctx.dtype), v_blk], 2).to(dt)
        return self.kernel(q.to(dt), k, v, causal, window, gqa)

    def kernel(self, q, k, v, causal: bool, window: int | None, gqa: bool) -> torch.Tensor:
        """Flex attention over the padded layout (compiled on CUDA) with the layer kind's block mask."""
        if (causal, window) not in self._masks:
            self._masks[causal, window] = block_mask(self.lay, causal, window)
        compiled = q.device.type == "cuda"
        with warnings.catch_warnings():
            if not compiled:  # forward-only checks off CUDA: the unfused path is the point there
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return _flex(compiled)(q, k, v, block_mask=self._masks[causal, window], enable_gqa=gqa)
