"""A verify step's 144 FP8 projections (a Qwen3-8B shape, 16 rows) in one persistent kernel on the FP8 tensor
cores, against the engine's launched kernels: what bounds the weight stream once no kernel boundary stops it?

A measurement, not used by the engine (docs/performance.md, FP8 targets). Run on a Hopper GPU with Triton 3.6
and the package importable (installed, or the repository root on PYTHONPATH): `python3 studies/fp8_ring.py
[VARIANT ...]` (`VARIANTS` below; one CUDA graph per variant, the median of 3 replays). It prints one line per
variant, a check of the outputs against torch where the variant computes them all, and the engine's tuned
launched kernels over the same bytes.

The kernel (`ring_gemms`), one program per CTA, all resident for the whole run:
- all 144 weights in one e4m3 tensor laid out tile by tile ([tiles x 128, 128]: each 128 x 128 tile one
  contiguous 16 KB run, in the order a program consumes them), one fp32 scale per tile (its 128 x 128 block);
- each program takes an even share of each GEMM's (N tile, K tile) steps (stream-K), K innermost, and keeps a
  ring of weight tiles in flight through TMA across GEMM boundaries (weights never wait for rows);
- a step quantizes its 16 rows x 128 columns per row (amax / 448, as transformers' FP8Linear does; fp32 rows
  read from L2 one step ahead), multiplies the tile by them on wgmma (the tile on the left: 128 weight rows,
  the 16 rows unpadded on the right) and adds the product times both scales into a [128, 16] fp32 sum, which
  goes out by fp32 atomics when the program's N tile changes; `async`: the next step's rows are quantized
  while the multiply runs;
- `chain`: GEMM g reads GEMM g-1's output (its first K columns) and waits (acquire) for a counter that every
  program bumps (release) once its share of g-1 is out: the real dependency chain of a step. Otherwise every
  GEMM reads the same input rows and nothing waits (the streaming alone);
- `work` takes parts away to find what bounds the loop (`WORKS`).
"""

from __future__ import annotations

import functools
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dflash_zoo.cuda.ops.runtime import graph_ms

ROWS, TILE, QMAX = 16, 128, 448.0
HIDDEN, KV, FFN, LAYERS = 4096, 1024, 12288, 36  # Qwen3-8B
# (N, K) of a layer's projections in step order: q/k/v, o, gate/up, down
SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)]
FFN_TILES = gl.constexpr(FFN // TILE)  # the shared input's 128-column groups
# int32 fields a GEMM: N tiles, K tiles, first tile, output column, input column, steps (and padding)
META = gl.constexpr(8)
SPIN_LIMIT = gl.constexpr(1 << 20)  # a wait gives up (and counts it) after this many polls: no hang


@gluon.jit
def _meta(Meta, g):
    """GEMM g's (K tiles, first tile, output column, input column, steps)."""
    m = Meta + g * META
    return gl.load(m + 1), gl.load(m + 2), gl.load(m + 3), gl.load(m + 4), gl.load(m + 5)


@gluon.jit
def _share(steps, pid, programs):
    """This program's steps [lo, hi) of a GEMM's `steps` (stream-K: even shares, whole steps)."""
    return steps * pid // programs, steps * (pid + 1) // programs


@gluon.jit
def _issue(w_desc, ring, bars, slot, tile, live):
    """TMA weight tile `tile` into ring slot `slot` (nothing once the cursor is past the last GEMM)."""
    bar = bars.index(slot)
    mbarrier.expect(bar, w_desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(w_desc, [tile * 128, 0], bar, ring.index(slot), pred=live)


@gluon.jit
def _advance(Meta, g, tile, end, pid, programs, n_gemms):
    """The producer's next tile: (GEMM, tile, end of its share); the next GEMM's share once `end` is reached
    (shares are never empty: every GEMM has at least `programs` steps). Metadata is read only then."""
    tile += 1
    if tile == end:
        g += 1
        m = Meta + gl.minimum(g, n_gemms - 1) * META
        lo, hi = _share(gl.load(m + 5), pid, programs)
        first = gl.load(m + 2)
        tile, end = first + lo, first + hi
    return g, tile, end


@gluon.jit
def _rows(Buf, stride, col, XL: gl.constexpr):
    """The fp32 rows [16, 128] from column `col` of the buffer, read from L2 (other SMs wrote them)."""
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, XL))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, XL))
    return gl.load(Buf + r[:, None] * stride + col + c[None, :], cache_modifier=".cg")


@gluon.jit
def _qrows(Xq, col):
    """Quantized rows (e4m3 bytes) [16, 128] from column `col` of the shared input's quantized copy."""
    QL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, QL))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
    return gl.load(Xq + r[:, None] * (FFN_TILES * 128) + col + c[None, :], cache_modifier=".cg")


@gluon.jit
def _quantize(x, dst, AL: gl.constexpr):
    """Rows x [16, 128] per row to e4m3 in `dst` (amax / 448; an all-zero row's scale tiny, its values 0);
    returns the scales [16] as the multiply's output columns see them."""
    amax = gl.maximum(gl.max(gl.abs(x), axis=1), 1e-30)
    xq = gl.minimum(gl.maximum(x * (448.0 / amax)[:, None], -448.0), 448.0)
    dst.store(xq.to(gl.float8e4nv))
    return gl.convert_layout(amax * (1.0 / 448.0), gl.SliceLayout(0, AL))


@gluon.jit
def _wait(Cnt, Flag, g, programs):
    """Spin (plain loads: 264 programs polling one word with atomics queue behind each other at L2) until every
    program has put out its share of GEMM g, then acquire; count a give-up in Flag."""
    c = gl.load(Cnt + g, volatile=True)
    polls = 0
    while (c < programs) & (polls < SPIN_LIMIT):
        c = gl.load(Cnt + g, volatile=True)
        polls += 1
    c = gl.atomic_add(Cnt + g, 0, sem="acquire", scope="gpu")
    if c < programs:
        gl.atomic_add(Flag, 1)


@gluon.jit
def ring_gemms(w_desc, Ws, Buf, Xq, Xs, Scratch, Meta, Cnt, Flag, stride, n_gemms, no_cols,
               RING: gl.constexpr, CHAIN: gl.constexpr, ASYNC: gl.constexpr, WORK: gl.constexpr,
               num_warps: gl.constexpr):  # fmt: skip
    pid, programs = gl.program_id(0), gl.num_programs(0)
    XL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])  # rows [16, 128]
    AL: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 16, 32]
    )
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    ring = gl.allocate_shared_memory(gl.float8e4nv, [RING, 128, 128], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    xq_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, 16, 128], XS)  # ASYNC: the next step's too
    for i in gl.static_range(RING):
        mbarrier.init(bars.index(i), count=1)
    # the producer's cursor runs RING steps ahead of the consumer's, across GEMMs
    pg = 0
    lo0, hi0 = _share(gl.load(Meta + 5), pid, programs)
    pt, pend = lo0 + gl.load(Meta + 2), hi0 + gl.load(Meta + 2)
    for i in gl.static_range(RING):
        _issue(w_desc, ring, bars, i, pt, pg < n_gemms)
        pg, pt, pend = _advance(Meta, pg, pt, pend, pid, programs, n_gemms)
    out_c = gl.arange(0, 128, layout=gl.SliceLayout(1, AL))
    out_r = gl.arange(0, 16, layout=gl.SliceLayout(0, AL))
    j = 0  # steps consumed: ring slot j % RING, phase (j // RING) & 1
    for g in range(n_gemms):
        kt, first, out_col, in_col, steps = _meta(Meta, g)
        lo, hi = _share(steps, pid, programs)
        if CHAIN:
            if g > 0:
                _wait(Cnt, Flag, g - 1, programs)
        acc = gl.zeros([128, 16], gl.float32, AL)
        w_scale = gl.load(Ws + first + lo)
        xs = gl.zeros([16], gl.float32, gl.SliceLayout(0, AL))
        x_next = _rows(Buf, stride, in_col + (lo % kt) * 128, XL)
        if WORK >= 6:
            q_next = _qrows(Xq, (lo % kt) * 128)
        if ASYNC:
            # the first step's rows quantized here; each step quantizes the next one's under its multiply
            xs = _quantize(x_next, xq_smem.index(0), AL)
            x_next = _rows(Buf, stride, in_col + ((lo + 1) % kt) * 128, XL)
        cur = 0
        for s in range(lo, hi):
            k = s % kt
            if WORK == 0:  # diagnostics: the weight stream alone (wait for the tile, refill its slot)
                mbarrier.wait(bars.index(j % RING), (j // RING) & 1)
                _issue(w_desc, ring, bars, j % RING, pt, pg < n_gemms)
                pg, pt, pend = _advance(Meta, pg, pt, pend, pid, programs, n_gemms)
                j += 1
            else:
                if WORK >= 6:  # rows quantized beforehand: e4m3 [16, 128] and their scales, read from L2
                    q = q_next
                    if s + 1 < hi:
                        q_next = _qrows(Xq, ((s + 1) % kt) * 128)
                    xq_smem.index(0).store(q.to(gl.float8e4nv, bitcast=True))
                    xs = gl.load(Xs + out_r * (FFN_TILES) + k, cache_modifier=".cg")
                elif WORK == 5:  # diagnostics: the multiply alone (the GEMM's first rows quantized once)
                    if s == lo:
                        xs = _quantize(x_next, xq_smem.index(0), AL)
                elif not ASYNC:
                    x = x_next
                    if s + 1 < hi:  # the next step's rows in flight (same GEMM: no wait between)
                        x_next = _rows(Buf, stride, in_col + ((s + 1) % kt) * 128, XL)
                    xs = _quantize(x, xq_smem.index(0), AL)
                fence_async_shared()
                slot = j % RING
                mbarrier.wait(bars.index(slot), (j // RING) & 1)
                # [128 weight rows, 128] x [128, 16 rows] on the FP8 tensor cores, then the slot is free again
                zero = gl.zeros([128, 16], gl.float32, AL)
                if ASYNC:
                    tok = warpgroup_mma(ring.index(slot), xq_smem.index(cur).permute((1, 0)), zero, use_acc=False,
                                        is_async=True)  # fmt: skip
                    xs_next = xs
                    if s + 1 < hi:
                        xs_next = _quantize(x_next, xq_smem.index(1 - cur), AL)
                        if s + 2 < hi:
                            x_next = _rows(Buf, stride, in_col + ((s + 2) % kt) * 128, XL)
                    part = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
                elif WORK == 3:  # diagnostics: rows and their quantization, no multiply
                    part = zero
                else:
                    part = warpgroup_mma(
                        ring.index(slot), xq_smem.index(0).permute((1, 0)), zero, use_acc=False
                    )
                _issue(w_desc, ring, bars, slot, pt, pg < n_gemms)
                pg, pt, pend = _advance(Meta, pg, pt, pend, pid, programs, n_gemms)
                acc += part * (w_scale * xs)[None, :]
                w_scale = gl.load(Ws + first + gl.minimum(s + 1, hi - 1))  # the next step's, in flight
                j += 1
                if (k == kt - 1) | (s == hi - 1):  # the N tile's sum out: [128 columns, 16 rows]
                    n = s // kt
                    ptr = Buf + out_r[None, :] * stride + out_col + n * 128 + out_c[:, None]
                    if WORK % 4 == 2:  # all work (2), or rows quantized beforehand (6)
                        gl.atomic_add(ptr, acc, sem="relaxed", scope="gpu")
                    elif WORK == 8:  # diagnostics: the sums stored, not added (one scratch tile a program)
                        gl.store(Scratch + pid * 2048 + out_r[None, :] * 128 + out_c[:, None], acc)
                    else:  # diagnostics: no atomics (a store the host's 0 columns never let happen)
                        gl.store(ptr, acc, mask=out_c[:, None] < no_cols)
                    acc = gl.zeros([128, 16], gl.float32, AL)
                if ASYNC:
                    xs = xs_next
                    cur = 1 - cur
        if CHAIN:
            gl.thread_barrier()  # every warp's atomics issued before the count
            gl.atomic_add(Cnt + g, 1, sem="release", scope="gpu")
    for i in gl.static_range(RING):
        mbarrier.invalidate(bars.index(i))


# ---- the host side --------------------------------------------------------------------------------------------
def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [16, K] -> e4m3 [16, K / 128, 128] and scales [16, K / 128, 1] as the kernel computes them: times
    448 / amax (not `fp8_format.quantize_rows`' IEEE quotient by amax / 448, which differs in the last bit)."""
    g = x.view(x.shape[0], -1, TILE)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return (g * (QMAX / amax)).clamp(-QMAX, QMAX).to(torch.float8_e4m3fn), amax / QMAX


class Step:
    """The 144 weights tile by tile, their scales, the rows/outputs buffer and each GEMM's metadata."""

    def __init__(self, device: torch.device, layers: int = LAYERS):
        shapes = SHAPES * layers
        self.shapes = shapes
        tiles = [(n // TILE) * (k // TILE) for n, k in shapes]
        self.first = [sum(tiles[:g]) for g in range(len(shapes))]
        total = sum(tiles)
        # random e4m3 bytes, bits 6 and 3 cleared: exponents up to 7 (|w| < 2), never NaN
        self.w = torch.empty(total * TILE, TILE, dtype=torch.uint8, device=device)
        for part in self.w.split(1 << 20):
            part.random_(0, 256).bitwise_and_(0xB7)
        self.w = self.w.view(torch.float8_e4m3fn)
        rms = self.w[: 1 << 16].float().pow(2).mean().sqrt().item()
        # one scale a tile: outputs keep their inputs' size through the chain
        ks = torch.tensor(
            [k for (n, k), t in zip(shapes, tiles, strict=True) for _ in range(t)], device=device
        )
        self.ws = (1.0 / (rms * ks.float().sqrt())) * (1 + 0.25 * torch.rand(total, device=device))
        self.in0 = FFN  # columns of the shared input rows
        self.out_col = [self.in0 + sum(n for n, _ in shapes[:g]) for g in range(len(shapes))]
        self.buf = torch.zeros(ROWS, self.out_col[-1] + shapes[-1][0], device=device)
        self.buf[:, : self.in0].normal_()
        # the shared input quantized beforehand (work 6): e4m3 bytes [16, FFN] and scales [16, FFN / 128]
        xq, xs = quantize_groups(self.buf[:, : self.in0])
        self.xq, self.xs = xq.view(torch.uint8).reshape(ROWS, FFN).contiguous(), xs.reshape(ROWS, -1)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.scratch = torch.zeros(4 * sms, ROWS * TILE, device=device)  # work 8: a tile of sums a program
        self.cnt = torch.zeros(len(shapes), dtype=torch.int32, device=device)
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)

    def meta(self, chain: bool) -> torch.Tensor:
        rows = []
        for g, (n, k) in enumerate(self.shapes):
            in_col = self.out_col[g - 1] if chain and g else 0
            rows.append(
                [
                    n // TILE,
                    k // TILE,
                    self.first[g],
                    self.out_col[g],
                    in_col,
                    (n // TILE) * (k // TILE),
                    0,
                    0,
                ]
            )
        return torch.tensor(rows, dtype=torch.int32, device=self.w.device)

    def reset(self):
        self.buf[:, self.in0 :].zero_()
        self.cnt.zero_()

    def reference(self, g: int, meta: torch.Tensor) -> torch.Tensor:
        """GEMM g in torch from the input the kernel read: rows quantized per 128 columns, tile by tile."""
        (n, k), in_col = self.shapes[g], int(meta[g, 4])
        xq, xs = quantize_groups(self.buf[:, in_col : in_col + k])
        xq = xq.float()
        t = self.first[g]
        w = (
            self.w[t * TILE : (t + (n // TILE) * (k // TILE)) * TILE]
            .float()
            .view(n // TILE, k // TILE, TILE, TILE)
        )
        s = self.ws[t : t + (n // TILE) * (k // TILE)].view(n // TILE, k // TILE)
        # [rows, kt, c] x [nt, kt, o, c] -> [rows, nt, kt, o], each product times its scales
        prod = torch.einsum("rkc,nkoc->rnko", xq, w) * s[None, :, :, None] * xs[:, None, :, :]
        return prod.sum(2).reshape(ROWS, n)


def run_ring(
    step: Step, meta: torch.Tensor, ring: int, per_sm: int, warps: int, asyn: int, work: int, chain: bool
):
    """One launch of the kernel over all programs; returns the compiled kernel."""
    sms = torch.cuda.get_device_properties(step.w.device).multi_processor_count
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    desc = TensorDescriptor.from_tensor(step.w, [TILE, TILE], layout)
    grid = (sms * per_sm,)
    if per_sm > 4:
        raise ValueError("at most 4 CTAs an SM (the scratch tiles of work 8)")
    return ring_gemms[grid](desc, step.ws, step.buf, step.xq, step.xs, step.scratch, meta, step.cnt, step.flag,
                            step.buf.stride(0), len(step.shapes), 0, RING=ring, CHAIN=chain, ASYNC=bool(asyn),
                            WORK=work, num_warps=warps)  # fmt: skip


def reset_and_run(step: Step, *args) -> None:
    step.reset()
    run_ring(step, *args)


def graph_us(fn, reps: int = 3) -> float:
    """Microseconds a call: the engine's timer (`reps` calls in one CUDA graph, the median of 3 replays)."""
    return graph_ms(fn, reps=reps) * 1e3


def check(step: Step, meta: torch.Tensor, label: str) -> None:
    gs = [0, 1, 2, 3, 4, 5, len(step.shapes) - 2, len(step.shapes) - 1]
    errs = []
    for g in gs:
        n = step.shapes[g][0]
        got = step.buf[:, step.out_col[g] : step.out_col[g] + n]
        ref = step.reference(g, meta)
        errs.append(((got - ref).norm() / ref.norm()).item())
    counts = step.cnt.tolist()
    print(f"check {label}: rel err {min(errs):.1e}..{max(errs):.1e} over GEMMs {gs}; counters "
          f"{min(counts)}..{max(counts)}; give-ups {int(step.flag.item())}", flush=True)  # fmt: skip


def engine_baseline(step: Step, w8a8: bool) -> float:
    """The engine's tuned launched kernels over the same bytes (each GEMM's tiles viewed as its [N, K])."""
    from dflash_zoo.cuda.ops import fp8

    x = {k: torch.randn(ROWS, k, device=step.w.device, dtype=torch.bfloat16) for k in (HIDDEN, FFN)}
    calls = []
    for g, (n, k) in enumerate(step.shapes):
        t = step.first[g]
        w = step.w[t * TILE : t * TILE + n * k // TILE].view(n, k)
        s = torch.full((n // TILE, k // TILE), 1e-3, device=w.device)
        calls.append((x[k], w, s))
    return graph_us(lambda: [fp8.linear_parts(xx, w, s, w8a8=w8a8) for xx, w, s in calls], reps=2)


# what a variant's loop does (`work`): 2 all of it; 1 no atomics (the sums dropped); 0 the weight stream alone
# (wait for the tile, refill its slot); 3 the rows and their quantization, no multiply, no atomics; 5 the
# multiply alone (each GEMM's first rows quantized once, no atomics); 6 all, the rows read already quantized
# (e4m3 and scales prepared by torch; streaming only); 7 as 6 without the sums going out; 8 as 6 with the sums
# stored to a tile of their own a program instead of added atomically (wrong results)
WORKS = {
    2: "",
    1: ", no atomics",
    0: ", TMA only",
    3: ", no multiply, no atomics",
    5: ", multiply only",
    6: ", rows quantized beforehand",
    7: ", rows quantized beforehand, no sums out",
    8: ", rows quantized beforehand, sums stored",
}
# (chain, ring, CTAs an SM, warps, async, work); a chain needs every CTA resident at once (their shared memory
# and registers). `python3 studies/fp8_ring.py 0,4,3,4,1,2 ...` runs the ones named
VARIANTS = [
    (0, 6, 2, 4, 0, 6),
    (0, 4, 3, 4, 0, 6),
    (0, 6, 2, 4, 0, 2),
    (0, 6, 2, 4, 0, 3),
    (0, 6, 2, 4, 0, 5),
    (0, 6, 2, 4, 0, 0),
    (1, 6, 2, 4, 0, 2),
]


def measure(step: Step, variant: tuple[int, ...], zero_us: float, props) -> None:
    """Build, check (all work only) and time one variant; prints its lines."""
    chain, ring, per_sm, warps, asyn, work = variant
    label = (
        f"{'chain' if chain else 'streaming'} ring {ring}, {per_sm} CTAs/SM, {warps} warps"
        f"{', async' if asyn else ''}{WORKS[work]}"
    )
    meta = step.meta(bool(chain))
    args = (step, meta, ring, per_sm, warps, asyn, work, bool(chain))
    step.reset()
    step.flag.zero_()
    k = run_ring(*args)
    torch.cuda.synchronize()
    smem, regs = k.metadata.shared, k.n_regs
    fits = per_sm * smem <= props.shared_memory_per_multiprocessor and per_sm * regs * 32 * warps <= 65536
    print(
        f"{label}: {smem} B shared, {regs} registers a thread: {'fits' if fits else 'does NOT fit'}",
        flush=True,
    )
    if chain and not fits:
        return
    if work in (2, 6):
        check(step, meta, label)
    us = graph_us(functools.partial(reset_and_run, *args)) - zero_us
    print(f"{label}: {us:.0f} us a step, {step.w.numel() / us / 1e6:.2f} TB/s", flush=True)


def main(argv: list[str]) -> None:
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    step = Step(device)
    gb = step.w.numel() / 1e9
    print(f"{props.name}, {props.multi_processor_count} SMs; {len(step.shapes)} GEMMs, {gb:.2f} GB of e4m3")
    zero_us = graph_us(step.reset)
    print(f"reset (outputs, counters) alone: {zero_us:.1f} us", flush=True)
    variants = [tuple(int(v) for v in a.split(",")) for a in argv] or VARIANTS
    for variant in variants:
        try:
            measure(step, variant, zero_us, props)
        except Exception as e:  # a variant that does not build or fit is reported, the rest still run
            print(f"{variant}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    us = engine_baseline(step, w8a8=False)
    print(f"engine, launched, tuned, weight-only: {us:.0f} us a step, {gb / us * 1e3:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
