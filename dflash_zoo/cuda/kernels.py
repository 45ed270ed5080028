"""Triton kernels for the static path's few-row steps: split-KV attention and a split-K one-row GEMV
(the elementwise work between them: fused_ops.py).

Why: at one query row per head (an autoregressive step) the masked SDPA kernel runs one block per KV head: 8
blocks on an H200's 132 SMs for Qwen3-8B, ~28 us a layer to read ~4.7 MB of K/V (docs/performance.md). Here
each program takes one KV head and one chunk of keys (~2 programs per SM), all the head's query rows at once
(GQA rows share the K/V tile), and a second kernel merges the chunks' partial softmaxes. Same masked semantics
as `attention._grouped_sdpa`: an additive mask row per query row; key tiles hidden from every row are skipped.

`gemv`: y = W x for one row, split over K as well as over output rows. At batch 1 a [4096, 12288] down
projection has only 4,096 rows to spread over the SMs; inductor's fused SiLU + GEMV reached 2.9 TB/s on it and
cuBLAS 3.35, against 4.3 for the wide gate/up (on an H200, docs/performance.md). Each program reduces a
[rows x K-slice] tile; a second kernel adds the slices (fixed order: deterministic). With `gate` the input is
HF's `act_fn(gate) * up` for SiLU, computed in the kernel with torch's rounding (each op rounded to the dtype).
The tile configuration is timed once per shape on CUDA (`_gemv_config`), outside graph capture.

Both are torch custom ops, so `torch.compile` sees one opaque call and CUDA graphs capture the launches. They
run on CUDA, or anywhere under Triton's interpreter (`TRITON_INTERPRET=1`, CPU tests). Triton is imported on
first use only.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("dflash_zoo")
TILE = 32  # keys per inner iteration
MAX_CHUNKS = 64  # partial results per (head, row) that the merge kernel reads at once
PROGRAMS_PER_SM = 2  # target (KV head, chunk) programs per SM; tile rounding lands between half and all of it
# largest [query rows x head dim] accumulator of one program: 128 x 128 fits an H200's shared memory, 128 x 512
# (8:1 GQA x 16 rows of Gemma 4's global layers) needs 528 KB and fails to compile
MAX_ACCUMULATOR = 128 * 128


def available(device: torch.device) -> str | None:
    """None when the kernels can run on `device`, else why not."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernels need a CUDA device (got {device.type})"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the Triton kernels need the `triton` package"
    return None


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def chunking(keys: int, heads: int, sms: int) -> tuple[int, int]:
    """(keys per chunk, chunks): whole tiles, at most MAX_CHUNKS chunks, ~PROGRAMS_PER_SM programs per SM."""
    want = max(1, min(MAX_CHUNKS, -(-PROGRAMS_PER_SM * sms // heads)))
    size = TILE * -(-keys // (want * TILE))
    return size, -(-keys // size)


@functools.cache
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(t: torch.Tensor) -> int:
    """SMs of the tensor's GPU (8 under the interpreter: only the chunking depends on it)."""
    return _sms_of(t.device.index or 0) if t.is_cuda else 8


@functools.cache
def _kernels():
    """Compile-on-first-use Triton kernels (imported here so that importing this module needs no triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def partial(Q, K, V, Bias, PO, PM, PL, scale, rows, keys, hd, chunk, n_chunks,
                R: tl.constexpr, D: tl.constexpr, N: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        h, c = tl.program_id(0), tl.program_id(1)  # KV head, key chunk
        r, d = tl.arange(0, R), tl.arange(0, D)
        rok, dok = r < rows, d < hd
        q = tl.load(
            Q + (h * rows + r[:, None]) * hd + d[None, :], mask=rok[:, None] & dok[None, :], other=0.0
        )
        m_i = tl.full([R], float("-inf"), tl.float32)  # running max per row
        l_i = tl.zeros([R], tl.float32)  # running sum of exponentials per row
        acc = tl.zeros([R, D], tl.float32)  # running un-normalised output per row
        for start in range(c * chunk, c * chunk + chunk, N):
            n = start + tl.arange(0, N)
            nok = n < keys
            bias = tl.load(
                Bias + r[:, None] * keys + n[None, :], mask=rok[:, None] & nok[None, :], other=float("-inf")
            )
            bias = bias.to(tl.float32)  # [R, N]
            if tl.max(tl.max(bias, 1), 0) > float("-inf"):  # a tile hidden from every row costs no K/V read
                kv = (h * keys + n[:, None]) * hd + d[None, :]
                kvok = nok[:, None] & dok[None, :]
                k = tl.load(K + kv, mask=kvok, other=0.0)  # [N, D]
                if IEEE:  # fp32 inputs: exact products, not TF32
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale + bias  # [R, N]
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # rows still fully hidden keep max -inf: subtract 0 instead, so exp(-inf) = 0, never NaN
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)  # rescale of what was summed under the old max
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + kv, mask=kvok, other=0.0)
                if IEEE:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        at = (h * n_chunks + c) * R + r  # [R] slots of this (head, chunk)
        tl.store(PM + at, m_i)
        tl.store(PL + at, l_i)
        tl.store(PO + at[:, None] * D + d[None, :], acc)

    @triton.jit
    def merge(PO, PM, PL, Out, rows, hd, n_chunks, R: tl.constexpr, D: tl.constexpr, C: tl.constexpr):
        h, row = tl.program_id(0), tl.program_id(1)
        c, d = tl.arange(0, C), tl.arange(0, D)
        cok = c < n_chunks
        at = (h * n_chunks + c) * R + row  # [C]
        m = tl.load(PM + at, mask=cok, other=float("-inf"))
        top = tl.max(m, 0)
        w = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))  # each chunk's share of the global max
        total = tl.sum(w * tl.load(PL + at, mask=cok, other=0.0), 0)
        part = tl.load(PO + at[:, None] * D + d[None, :], mask=cok[:, None], other=0.0)  # [C, D]
        out = tl.sum(w[:, None] * part, 0) / total
        tl.store(Out + (h * rows + row) * hd + d, out.to(Out.dtype.element_ty), mask=d < hd)

    @triton.jit
    def gemv_part(
        W, X, Gate, Part, n_out, k_in, k_split, BN: tl.constexpr, BK: tl.constexpr, SILU: tl.constexpr
    ):
        pn, ps = tl.program_id(0), tl.program_id(1)  # output rows, K slice
        rows = pn * BN + tl.arange(0, BN)
        rok = rows < n_out
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(ps * k_split, ps * k_split + k_split, BK):
            cols = k0 + tl.arange(0, BK)
            cok = cols < k_in
            x = tl.load(X + cols, mask=cok, other=0.0)
            if SILU:  # HF's act_fn(gate) * up; like torch, silu and the product are each rounded to the dtype
                g = tl.load(Gate + cols, mask=cok, other=0.0).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g))).to(x.dtype)
                x = (a.to(tl.float32) * x.to(tl.float32)).to(x.dtype)
            w = tl.load(W + rows[:, None] * k_in + cols[None, :], mask=rok[:, None] & cok[None, :], other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        tl.store(Part + ps * n_out + rows, tl.sum(acc, 1), mask=rok)

    @triton.jit
    def gemv_sum(Part, Bias, Out, n_out, splits, BLOCK: tl.constexpr, S: tl.constexpr, BIAS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rok = rows < n_out
        s = tl.arange(0, S)
        y = tl.sum(
            tl.load(
                Part + s[:, None] * n_out + rows[None, :],
                mask=(s < splits)[:, None] & rok[None, :],
                other=0.0,
            ),
            0,
        )
        if BIAS:
            y += tl.load(Bias + rows, mask=rok, other=0.0).to(tl.float32)
        tl.store(Out + rows, y.to(Out.dtype.element_ty), mask=rok)

    return partial, merge, gemv_part, gemv_sum


@torch.library.custom_op("dflash_zoo::split_kv_attention", mutates_args=())
def split_kv_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [kvh, rows, d] (a head's GQA query rows); k, v [kvh, S, d]; bias [rows, S] additive -> [kvh, rows, d]."""
    kvh, rows, hd = q.shape
    step = max(1, MAX_ACCUMULATOR // _pow2(hd))  # rows per launch: the [rows, d] fp32 tile must fit on chip
    if _pow2(rows) * _pow2(hd) > MAX_ACCUMULATOR and rows > step:  # e.g. Gemma 4's 512-wide global heads
        parts = [slice(r, min(rows, r + step)) for r in range(0, rows, step)]
        return torch.cat([split_kv_attention(q[:, p], k, v, bias[p], scale) for p in parts], dim=1)
    keys = k.shape[1]
    q, k, v, bias = q.contiguous(), k.contiguous(), v.contiguous(), bias.contiguous()
    big_r, big_d = _pow2(rows), _pow2(hd)
    chunk, n_chunks = chunking(keys, kvh, _sms(q))
    f32 = dict(device=q.device, dtype=torch.float32)
    pm, pl = torch.empty(kvh, n_chunks, big_r, **f32), torch.empty(kvh, n_chunks, big_r, **f32)
    po = torch.empty(kvh, n_chunks, big_r, big_d, **f32)
    out = torch.empty_like(q)
    partial, merge = _kernels()[:2]
    ieee = q.dtype == torch.float32
    warps = 4 if big_r * big_d <= 8192 else 8  # e.g. 8:1 GQA x 16-row blocks: a [128, 128] fp32 accumulator
    meta = dict(R=big_r, D=big_d, N=TILE, IEEE=ieee, num_warps=warps)
    partial[(kvh, n_chunks)](q, k, v, bias, po, pm, pl, scale, rows, keys, hd, chunk, n_chunks, **meta)
    merge[(kvh, rows)](po, pm, pl, out, rows, hd, n_chunks, R=big_r, D=big_d, C=_pow2(n_chunks, 1))
    return out


@split_kv_attention.register_fake
def _(q, k, v, bias, scale):
    return torch.empty_like(q)


# (rows per program, K per iteration, programs per SM, warps): the candidates `_gemv_config` times per shape
GEMV_CONFIGS = [
    (bn, bk, per_sm, 4 if bn * bk <= 4096 else 8)
    for bn in (8, 16, 32)
    for bk in (128, 256)
    for per_sm in (4, 8)
]
_tuned: dict[tuple, tuple[int, int, int, int]] = {}


def _gemv_launch(x, weight, bias, gate, config) -> torch.Tensor:
    n, k = weight.shape
    bn, bk, per_sm, warps = config
    blocks = -(-n // bn)
    splits = max(1, min(-(-k // bk), -(-per_sm * _sms(x) // blocks)))
    k_split = bk * -(-k // (splits * bk))
    splits = -(-k // k_split)
    part = torch.empty(splits, n, device=x.device, dtype=torch.float32)
    out = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    _, _, gemv_part, gemv_sum = _kernels()
    g = gate if gate is not None else x
    gemv_part[(blocks, splits)](
        weight, x, g, part, n, k, k_split, BN=bn, BK=bk, SILU=gate is not None, num_warps=warps
    )
    b = bias if bias is not None else part
    gemv_sum[(-(-n // 256),)](part, b, out, n, splits, BLOCK=256, S=_pow2(splits, 1), BIAS=bias is not None)
    return out


def _graph_ms(fn, reps: int = 10) -> float:
    """Milliseconds per call of `fn`, `reps` calls captured in one CUDA graph (launch cost as in a step)."""
    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _gemv_config(x, weight, gate) -> tuple[int, int, int, int]:
    """The fastest of GEMV_CONFIGS for this shape, timed once on CUDA (the first one under the interpreter).

    Each timed call follows a write of 128 MB (over twice an H200's L2), so that the weight comes from HBM as
    in a real step.
    """
    key = (tuple(weight.shape), weight.dtype, gate is not None, x.device)
    if key in _tuned:
        return _tuned[key]
    if not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return GEMV_CONFIGS[0]  # nothing timed while a graph is captured (steps are warmed before capture)
    flush = torch.empty(2**25, device=x.device, dtype=torch.float32)
    base = _graph_ms(flush.zero_)
    times = {
        c: _graph_ms(lambda c=c: (flush.zero_(), _gemv_launch(x, weight, None, gate, c))) - base
        for c in GEMV_CONFIGS
    }
    _tuned[key] = best = min(times, key=times.get)
    log.debug("gemv %s: %s (%.1f us)", key[:3], best, times[best] * 1e3)
    return best


def tuned_configs() -> dict[str, list[int]]:
    """The GEMV configs timed so far, by weight shape ("4096x12288+silu"), for bench records."""
    return {f"{n}x{k}{'+silu' if silu else ''}": list(c) for ((n, k), _, silu, _), c in _tuned.items()}


@torch.library.custom_op("dflash_zoo::gemv", mutates_args=())
def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor | None
) -> torch.Tensor:
    """One row x [..., K] (all leading sizes 1) -> weight [N, K] @ x (+ bias) [..., N]; with `gate`
    [..., K], the input is silu(gate) * x (a SwiGLU down projection's)."""
    if x.numel() != x.shape[-1]:
        raise ValueError(f"gemv takes one row, not {list(x.shape)}")
    x, weight = x.contiguous(), weight.contiguous()  # no copies for the static path's tensors
    gate = gate.contiguous() if gate is not None else None
    return _gemv_launch(x, weight, bias, gate, _gemv_config(x, weight, gate))


@gemv.register_fake
def _(x, weight, bias, gate):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
