"""The Triton kernels (cuda/ops/attention.py, fused.py, gemv.py): split-KV attention against masked SDPA, the split-K GEMV
against `F.linear`, the fused norm + rotary + K/V write, RMSNorm and SwiGLU against the torch ops, all inside
the fast path, and when the engine picks them.

On CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, numpy), which has no bfloat16
(its bf16 dot returns garbage), so CPU tests use fp32 and fp16; the GPU tests cover bf16.
"""

from __future__ import annotations

import itertools
import os
import types

import pytest
import torch
import torch.nn.functional as F

from dflash_zoo.cuda.ops import attention as attn_ops
from dflash_zoo.cuda.ops import fused as fused_ops
from dflash_zoo.cuda.ops import gemv, runtime
from dflash_zoo.cuda.ops.attention import group_mask, grouped_sdpa, grouped_sinks, grouped_split
from dflash_zoo.cuda.static.linear import Parts
from dflash_zoo.cuda.static.norms import Norms
from dflash_zoo.engine.results import GenerationConfig
from dflash_zoo.engine.rope import apply_rotary
from tests.static_matrix import STATIC_MODEL_TYPES, fast_engine
from tests.test_fast import (
    MASK,
    _assert_both_paths_equal_ar,
    _capturable,
    _eager,
    _full_block_steps,
    _pair,
    _prompts,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def interpret():
    """Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1 without CUDA, before triton is imported)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA present: the GPU tests run the compiled kernel")
    pytest.importorskip("triton")


def _case(kvh, rows, hd, keys, visible, dtype, device="cpu"):
    """Random q [kvh, rows, hd], k, v [kvh, keys, hd], and an additive mask: row r sees keys < visible - r % 5."""
    gen = torch.Generator(device).manual_seed(kvh * 1000 + rows + keys)
    q, k, v = (torch.randn(kvh, n, hd, generator=gen, device=device).to(dtype) for n in (rows, keys, keys))
    seen = (
        torch.arange(keys, device=device)[None, :]
        < (visible - torch.arange(rows, device=device) % 5)[:, None]
    )
    bias = torch.zeros(rows, keys, device=device, dtype=dtype).masked_fill_(~seen, float("-inf"))
    return q, k, v, bias


def _reference(q, k, v, bias, scale):
    f = [x.float() for x in (q, k, v, bias)]
    return F.scaled_dot_product_attention(*f[:3], attn_mask=f[3], scale=scale)


# (kvh, rows, hd, keys, visible): one decode row per head of a 4:1 GQA, a 16-row verify, a non power-of-two
# head size with a partial last tile, and keys mostly hidden (whole chunks skipped)
CASES = [(2, 4, 64, 200, 137), (2, 64, 128, 256, 250), (1, 3, 80, 70, 40), (3, 5, 32, 512, 9)]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_split_attention_equals_masked_sdpa(interpret, case, dtype, tol):
    q, k, v, bias = _case(*case, dtype)
    out = attn_ops.split_kv_attention(q, k, v, bias, 0.125)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), _reference(q, k, v, bias, 0.125), atol=tol, rtol=tol)
    # hidden keys do not count, however large
    k[:, case[4] :] = 1e4
    v[:, case[4] :] = -1e4
    torch.testing.assert_close(out, attn_ops.split_kv_attention(q, k, v, bias, 0.125))


def test_wide_heads_split_their_rows_across_launches(interpret, monkeypatch):
    """A [rows, head dim] tile over the on-chip limit (Gemma 4's 512-wide global heads x 8:1 GQA x 16 rows) runs
    in row slices; the result is the same attention."""
    monkeypatch.setattr(attn_ops, "MAX_ACCUMULATOR", 16 * 64)  # the slicing of a 128 x 512 tile, at test size
    q, k, v, bias = _case(2, 40, 64, 96, 90, torch.float32)
    got = attn_ops.split_kv_attention(q, k, v, bias, 0.125)
    torch.testing.assert_close(got, _reference(q, k, v, bias, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wide", [False, True], ids=["one launch", "row slices"])
def test_split_attention_writes_token_major_rows(interpret, monkeypatch, wide):
    """With `tokens`, the merge writes grouped row (i, t) of KV head h as query head h g + i of token t: the
    grouped output reordered, also where wide heads run in row slices."""
    if wide:
        monkeypatch.setattr(attn_ops, "MAX_ACCUMULATOR", 16 * 64)
    kvh, g, t, hd = 2, 4, 5, 64
    q, k, v, bias = _case(kvh, g * t, hd, 96, 90, torch.float32)
    grouped = attn_ops.split_kv_attention(q, k, v, bias, 0.125)  # [kvh, (i, t), hd]
    got = attn_ops.split_kv_attention(q, k, v, bias, 0.125, tokens=t)
    want = grouped.view(kvh, g, t, hd).permute(2, 0, 1, 3).reshape(t, kvh * g, hd)
    assert got.shape == (t, kvh * g, hd) and torch.equal(got, want)
    assert not torch.equal(got.reshape(-1), grouped.reshape(-1))  # the order did change


def testgrouped_split_isgrouped_sdpa(interpret):
    """The static path's wrapper keeps `grouped_sdpa`'s GQA row order, for one row and for a block."""
    for t in (1, 6):
        gen = torch.Generator().manual_seed(t)
        q, k, v = (torch.randn(1, n, r, 16, generator=gen) for n, r in ((4, t), (2, 96), (2, 96)))
        gmask = group_mask(torch.arange(96)[None, :] <= torch.arange(40, 40 + t)[:, None], 2, torch.float32)
        torch.testing.assert_close(grouped_split(q, k, v, gmask, 0.3), grouped_sdpa(q, k, v, gmask, 0.3))


def test_split_attention_with_sinks_is_the_sink_softmax(interpret, monkeypatch):
    """gpt-oss sinks in the split kernel's merge: `grouped_sinks` for one row and a block, a sliding window
    hiding most keys, large and small sinks (one above every score), and rows split over launches."""
    for t, sink_scale in ((1, 1.0), (6, 8.0)):
        gen = torch.Generator().manual_seed(10 + t)
        q, k, v = (torch.randn(1, n, r, 16, generator=gen) for n, r in ((4, t), (2, 96), (2, 96)))
        pos = torch.arange(40, 40 + t)[:, None]
        seen = (torch.arange(96)[None, :] <= pos) & (pos - torch.arange(96)[None, :] < 12)  # window 12
        gmask = group_mask(seen, 2, torch.float32)
        sinks = torch.randn(4, generator=gen) * sink_scale
        want = grouped_sinks(q, k, v, gmask, 0.3, sinks)
        torch.testing.assert_close(grouped_split(q, k, v, gmask, 0.3, sinks), want)
        assert not torch.allclose(grouped_split(q, k, v, gmask, 0.3), want)  # the sinks changed it
        monkeypatch.setattr(attn_ops, "MAX_ACCUMULATOR", 2 * 16)  # two rows a launch: sinks sliced with them
        torch.testing.assert_close(grouped_split(q, k, v, gmask, 0.3, sinks), want)
        monkeypatch.undo()


@pytest.mark.parametrize("keys, heads, sms", [(1152, 8, 132), (33_000, 8, 132), (70, 1, 8), (64, 64, 132)])
def test_chunking_covers_every_key_in_whole_tiles(keys, heads, sms):
    size, n = attn_ops.chunking(keys, heads, sms)
    assert size % attn_ops.TILE == 0 and 1 <= n <= attn_ops.MAX_CHUNKS
    assert (n - 1) * size < keys <= n * size  # every key in exactly one chunk, no empty chunk
    # at least half the wanted programs, unless the keys or MAX_CHUNKS run out first
    want = attn_ops.PROGRAMS_PER_SM * sms
    assert 2 * n * heads >= min(want, attn_ops.MAX_CHUNKS * heads, -(-keys // attn_ops.TILE) * heads)


# (out, in): more rows than any tile, a partial K tile, fewer rows than the smallest tile
GEMV_SHAPES = [(100, 300), (64, 1000), (6, 40)]


@pytest.mark.parametrize("config", gemv.GEMV_CONFIGS, ids=str)
def test_gemv_equals_linear_for_every_config(interpret, config):
    """Every tile configuration the CUDA tuner may pick: fp32 W x + b, and W (silu(gate) * x) + b."""
    gen = torch.Generator().manual_seed(0)
    for n, k in GEMV_SHAPES:
        x, gate = torch.randn(2, 1, 1, k, generator=gen)
        w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        close = dict(atol=1e-4, rtol=1e-4)  # fp32 sums of up to 1,000 terms, in another order than torch's
        torch.testing.assert_close(gemv._gemv_launch(x, w, bias, None, config), F.linear(x, w, bias), **close)
        want = F.linear(F.silu(gate) * x, w, bias)  # e.g. Llama's mlp_bias on the down projection
        torch.testing.assert_close(gemv._gemv_launch(x, w, bias, gate, config), want, **close)


@pytest.mark.parametrize("config", gemv.GEMM_CONFIGS, ids=str)
def test_few_row_gemm_equals_linear_for_every_config(interpret, config):
    """2..16 rows on the tensor-core kernel, every config the tuner may pick (one K slice writing the output,
    or partial sums and the sum kernel): fp32 x W^T + b, and silu(gate) * up over the strided halves of one
    projection, as `F.linear` (rows padded to 16 inside; a padded row must not leak)."""
    gen = torch.Generator().manual_seed(8)
    close = dict(atol=1e-4, rtol=1e-4)
    for rows, (n, k) in [(5, (72, 300)), (16, (200, 1000))]:
        x = torch.randn(1, rows, k, generator=gen)
        w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        torch.testing.assert_close(gemv._gemv_launch(x, w, bias, None, config), F.linear(x, w, bias), **close)
        gate, up = torch.randn(1, rows, 2 * k, generator=gen).split(k, dim=-1)  # row stride 2k
        want = F.linear(F.silu(gate) * up, w, bias)
        torch.testing.assert_close(gemv._gemv_launch(up, w, bias, gate, config), want, **close)
        parts = gemv._gemv_parts(up, w, gate, config)  # [splits, rows, n]
        torch.testing.assert_close(parts.sum(0) + bias, want[0], **close)
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv.gemv_parts(torch.randn(1, 17, 8), torch.randn(4, 8), None)


def test_add_rms_norm_sums_few_row_parts(interpret):
    """Partial sums of a 5-row GEMV as the residual's delta: each row adds its own rows' sums."""
    gen = torch.Generator().manual_seed(9)
    x, inp = torch.randn(1, 5, 64, generator=gen), torch.randn(1, 5, 300, generator=gen)
    w, wd = torch.rand(64, generator=gen) + 0.5, torch.randn(64, 300, generator=gen)
    parts = gemv._gemv_parts(inp, wd, None, (64, 64, 4, 4, 2))
    assert parts.shape[:2] == (parts.shape[0], 5) and parts.shape[0] > 1
    total, y = fused_ops.add_rms_norm(x, parts, w, 1e-6, parts=True)
    torch.testing.assert_close(total, x + F.linear(inp, wd), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y, fused_ops.rms_norm(total, w, 1e-6))


@pytest.mark.parametrize("act", sorted(gemv.ACTS))
def test_gemv_rounds_the_fused_input_as_torch_does(interpret, act):
    """fp16: act(gate) * up made inside the kernel (SiLU, or Gemma's GELU tanh form) is the input torch makes
    (each op rounded; GELU's tanh taken as a sigmoid may move one value by a rounding); the parts too."""
    gen = torch.Generator().manual_seed(1)
    x, gate = (torch.randn(1, 1, 512, generator=gen).mul(2).half() for _ in range(2))
    w = torch.randn(64, 512, generator=gen).half()
    code, op = gemv.ACTS[act], gemv.ACT_OPS[gemv.ACTS[act]]
    fused = gemv.gemv(x, w, None, gate, code)
    unfused = gemv.gemv(op(gate) * x, w, None, None)
    torch.testing.assert_close(fused, unfused, atol=0.02, rtol=2e-3)
    assert (fused != unfused).sum() <= (0 if act == "silu" else 2)
    torch.testing.assert_close(
        fused.float(), F.linear((op(gate) * x).float(), w.float()), atol=0.05, rtol=2e-3
    )
    parts = gemv.gemv_parts(x, w, gate, act=code)
    torch.testing.assert_close(parts.sum(0).half().view(fused.shape), fused, atol=0.02, rtol=2e-3)
    other = gemv.ACT_OPS[gemv.ACTS["silu" if act != "silu" else "gelu_tanh"]]
    assert not torch.allclose(
        fused.float(), F.linear((other(gate) * x).float(), w.float()), atol=0.05, rtol=2e-3
    )
    with pytest.raises(ValueError, match="gate activation"):
        gemv.gemv(x, w, None, gate, 2)


@pytest.mark.parametrize("config", [gemv.GEMV_CONFIGS[0], gemv.GEMV_CONFIGS[-1]], ids=str)
def test_gemv_reads_a_gate_up_gemv_s_partial_sums(interpret, config):
    """The down GEMV's input given as the fp32 partial sums of the gate/up GEMV that made it (three slices of
    [1, 2K], gate and up halves as strided views): the same output and partial sums as from their sums rounded
    to the dtype (what `gemv` returns), with and without prefetch; cuBLAS sums them first."""
    gen = torch.Generator().manual_seed(13)
    k, n = 160, 48
    sums = torch.randn(3, 1, 2 * k, generator=gen)
    gate, up = sums[..., :k], sums[..., k:]
    w = torch.randn(n, k, generator=gen).half()
    g16, u16 = (y.sum(0).half() for y in (gate, up))
    want = gemv._gemv_launch(u16, w, None, g16, config)
    got = gemv._gemv_launch(up, w, None, gate, config, in_parts=True)
    assert got.shape == (1, n) and got.dtype == torch.float16 and torch.equal(got, want)
    parts = gemv._gemv_parts(up, w, gate, config, in_parts=True)
    assert torch.equal(parts, gemv._gemv_parts(u16, w, g16, config))
    torch.testing.assert_close(
        gemv._gemv_launch(up, w, None, gate, gemv.CUBLAS, in_parts=True), want, atol=0.02, rtol=2e-3
    )
    assert torch.equal(gemv.gemv(up, w, None, gate, 1, True), gemv.gemv(u16, w, None, g16))
    with pytest.raises(ValueError, match="partial sums as input"):
        gemv.gemv(up.half(), w, None, gate, 1, True)


def _rope_reference(qkv, q_w, k_w, cos, sin, positions, k_cache, v_cache, heads, eps):
    """`rope_store` as the static path's torch ops: norm (weight * rms_norm), rotary, index copies."""
    t, (kvh, _, hd) = qkv.shape[0], k_cache.shape
    q, k, v = (x.view(1, t, -1, hd) for x in qkv.split([heads * hd, kvh * hd, kvh * hd], -1))
    if q_w is not None:
        q, k = (w * F.rms_norm(x, (hd,), eps=eps) for w, x in ((q_w, q), (k_w, k)))
    k_cache.index_copy_(1, positions, apply_rotary(k.transpose(1, 2), cos, sin)[0])
    v_cache.index_copy_(1, positions, v[0].transpose(0, 1))
    return apply_rotary(q.transpose(1, 2), cos, sin)[0]


# (heads, kvh, hd, rotated dims, rows, qk norm): GQA verify rows, one decode row with partial rotary, a drafter
# context append (k/v only), Llama (no qk norm) with a non power-of-two head size
ROPE_CASES = [
    (4, 2, 64, 64, 5, True),
    (4, 2, 64, 32, 1, True),
    (0, 2, 64, 64, 3, True),
    (6, 2, 48, 48, 16, False),
]


def _rope_case(case, dtype, device="cpu"):
    """Random inputs of `rope_store` for a ROPE_CASES entry: (qkv, q_w, k_w, cos, sin, positions, k, v, heads)."""
    heads, kvh, hd, rot, t, norm = case
    gen = torch.Generator().manual_seed(hd + t)
    qkv = torch.randn(t, (heads + 2 * kvh) * hd, generator=gen)
    w = [torch.rand(hd, generator=gen) + 0.5 if norm else None for _ in range(2)]
    angle = torch.rand(t, rot // 2, generator=gen) * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1) for f in (torch.cos, torch.sin))
    caches = [torch.randn(kvh, 20, hd, generator=gen) for _ in range(2)]
    moved = [None if x is None else x.to(device, dtype) for x in (qkv, *w, cos, sin)]
    positions = torch.randperm(20, generator=gen)[:t].to(device)
    return (*moved, positions, *(c.to(device, dtype) for c in caches), heads)


def _rope_both(args):
    """(kernel q, kernel caches, reference q, reference caches) for one `_rope_case`."""
    *head, k, v, heads = args
    ref_caches = [k.clone(), v.clone()]
    want = _rope_reference(*head, *ref_caches, heads, 1e-6)
    return fused_ops.rope_store(*head, k, v, heads, 1e-6), (k, v), want, ref_caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ROPE_CASES, ids=str)
def test_rope_store_equals_the_torch_ops(interpret, case, dtype):
    """fp16: bitwise (each product rounded as torch rounds it); fp32: the norm's sum may differ in the last bit.
    Only the rows at `positions` of the caches change."""
    got, caches, want, ref_caches = _rope_both(_rope_case(case, dtype))
    assert got.shape == (case[0], case[4], case[2]) and got.dtype == dtype
    if dtype == torch.float16 or not case[5]:
        assert torch.equal(got, want) and torch.equal(caches[0], ref_caches[0])
    else:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(caches[0], ref_caches[0], atol=2e-6, rtol=2e-6)
    assert torch.equal(caches[1], ref_caches[1])  # V: copied as it is


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_sums_a_gemv_s_partial_sums(interpret, dtype):
    """qkv as the fp32 partial sums of its GEMV ([splits, 1, width], five slices: more than one unrolled round):
    the same q and caches as from their in-order sum rounded to the dtype (what `gemv` returns)."""
    heads, kvh, hd, rot, t = 4, 2, 32, 16, 1
    gen = torch.Generator().manual_seed(12)
    sums = torch.randn(5, t, (heads + 2 * kvh) * hd, generator=gen)
    qw, kw = ((torch.rand(hd, generator=gen) + 0.5).to(dtype) for _ in range(2))
    angle = torch.rand(t, rot // 2, generator=gen) * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    positions = torch.tensor([3])
    caches = [[torch.zeros(kvh, 8, hd, dtype=dtype) for _ in range(2)] for _ in range(2)]
    got = fused_ops.rope_store(sums, qw, kw, cos, sin, positions, *caches[0], heads, 1e-6, parts=True)
    want = fused_ops.rope_store(sums.sum(0).to(dtype), qw, kw, cos, sin, positions, *caches[1], heads, 1e-6)
    assert got.dtype == dtype and torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))
    with pytest.raises(ValueError, match="ungated"):
        fused_ops.rope_store(
            sums, qw, kw, cos, sin, positions, *caches[0], heads, 1e-6, gated=True, parts=True
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_gated_heads_in_the_fp32_norm_formula(interpret, dtype):
    """Qwen3.5's gated attention: q heads of [query | gate] (the gates stay where they are), q/k norms of the
    fp32 (1 + weight) formula, partial rotary: q and the caches as the torch ops (`fused_ops.rms_norm` of that
    formula, then the rotation) give them."""
    heads, kvh, hd, rot, t = 4, 2, 64, 16, 3
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(t, (2 * heads + 2 * kvh) * hd, generator=gen).to(dtype)
    qw, kw = ((torch.rand(hd, generator=gen) - 0.5).to(dtype) for _ in range(2))  # zero-centred weights
    angle = torch.rand(t, rot // 2, generator=gen) * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    positions = torch.tensor([7, 2, 11])
    caches = [torch.zeros(kvh, 16, hd, dtype=dtype) for _ in range(2)]
    got = fused_ops.rope_store(qkv, qw, kw, cos, sin, positions, *caches, heads, 1e-6, True, True, 1.0)
    q = qkv[:, : 2 * heads * hd].view(t, heads, 2, hd)[:, :, 0]  # [T, heads, hd]
    k, v = qkv[:, 2 * heads * hd :].split(kvh * hd, dim=-1)
    q, k = (fused_ops.rms_norm(y.reshape(t, -1, hd), w, 1e-6, True, 1.0) for y, w in ((q, qw), (k, kw)))
    want_q = apply_rotary(q[None].transpose(1, 2), cos, sin)[0]
    want_k = apply_rotary(k[None].transpose(1, 2), cos, sin)[0]
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(got, want_q, **tol)
    torch.testing.assert_close(caches[0][:, positions], want_k, **tol)
    assert torch.equal(caches[1][:, positions], v.view(t, kvh, hd).transpose(0, 1))
    plain = fused_ops.rope_store(
        qkv, qw, kw, cos, sin, positions, *caches, heads, 1e-6, True
    )  # Llama formula
    assert not torch.allclose(plain.float(), got.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k_eq_v", [False, True], ids=["v_proj", "k_eq_v"])
def test_rope_store_gemma_value_norm_and_values_from_the_keys(interpret, dtype, k_eq_v):
    """Gemma 4's attention: q/k norms of the fp32-weight formula, a weightless value norm (its module), and on
    global layers no v projection (the values are the keys before their norm): q and both caches as Gemma's
    modules and the rotation give them."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    heads, kvh, hd, rot, t = 4, 2, 32, 32, 3
    gen = torch.Generator().manual_seed(10)
    qkv = torch.randn(t, (heads + (1 if k_eq_v else 2) * kvh) * hd, generator=gen).to(dtype)
    qn, kn, vn = Gemma4RMSNorm(hd, 1e-6), Gemma4RMSNorm(hd, 1e-6), Gemma4RMSNorm(hd, 1e-6, with_scale=False)
    with torch.no_grad():
        for n in (qn, kn):
            n.weight.copy_(torch.rand(hd, generator=gen) + 0.5)
    qn, kn = qn.to(dtype), kn.to(dtype)
    angle = torch.rand(t, rot // 2, generator=gen) * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    positions = torch.tensor([5, 0, 9])
    caches = [torch.zeros(kvh, 12, hd, dtype=dtype) for _ in range(2)]
    got = fused_ops.rope_store(qkv, qn.weight, kn.weight, cos, sin, positions, *caches, heads, 1e-6, False, True,
                               0.0, True, k_eq_v)  # fmt: skip
    q, k = qkv[:, : heads * hd], qkv[:, heads * hd : (heads + kvh) * hd]
    v = k if k_eq_v else qkv[:, (heads + kvh) * hd :]
    with torch.no_grad():
        want_q = apply_rotary(qn(q.view(1, t, heads, hd)).transpose(1, 2), cos, sin)[0]
        want_k = apply_rotary(kn(k.view(1, t, kvh, hd)).transpose(1, 2), cos, sin)[0]
        want_v = vn(v.view(t, kvh, hd)).transpose(0, 1)
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(got, want_q, **tol)
    torch.testing.assert_close(caches[0][:, positions], want_k, **tol)
    torch.testing.assert_close(caches[1][:, positions], want_v, **tol)
    assert not torch.allclose(caches[1][:, positions].float(), v.view(t, kvh, hd).transpose(0, 1).float())
    if k_eq_v:  # the width of q and k only: read as q, k, v it is too narrow
        with pytest.raises(ValueError, match="qkv width"):
            fused_ops.rope_store(qkv, qn.weight, kn.weight, cos, sin, positions, *caches, heads, 1e-6)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_gated_attention_layers_take_the_rope_kernel(interpret, model_type):
    """With the kernels on, every gated full-attention layer of a hybrid target runs `rope_store`, and a GDN
    layer's one-row output projection leaves its partial sums to the next norm (`Parts`), as attention's o
    projection does (their tokens against the eager loop: `test_fast_path_with_split_kernels_equals_eager`)."""
    adapter, drafter = _pair(model_type)
    eng = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, gemv=True, fused_ops=True)
    t = eng.target
    attention = [i for i, q in enumerate(t.qkv) if q is not None]
    assert attention and all(t.rope_kernel[i] and t.opts[i].gated for i in attention)
    gdn = [i for i, g in enumerate(t.gdn) if g is not None]
    assert gdn and all(t.fold_o[i] for i in gdn)
    h = torch.randn(1, 1, adapter.text_config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = [s.clone() for s in t.gdn[gdn[0]].states()]
        parts = t.gdn[gdn[0]](h, "step", fold=True)
        for s, b in zip(t.gdn[gdn[0]].states(), before, strict=True):
            s.copy_(b)
        plain = t.gdn[gdn[0]](h, "step")
    assert isinstance(parts, Parts)
    torch.testing.assert_close(parts.total(plain), plain, rtol=1e-5, atol=1e-6)


def test_rope_store_rejects_a_width_that_is_not_its_heads_and_strided_caches(interpret):
    caches = [torch.zeros(2, 8, 16) for _ in range(2)]
    rope = (torch.ones(1, 16), torch.zeros(1, 16), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"qkv width 96 is not 4 x 16 \+ 2 x 2 x 16"):
        fused_ops.rope_store(torch.zeros(1, 96), None, None, *rope, *caches, 4, 1e-6)
    strided = torch.zeros(8, 2, 16).transpose(0, 1)  # [2, 8, 16] as a view, not laid out so
    with pytest.raises(ValueError, match="contiguous"):
        fused_ops.rope_store(torch.zeros(1, 128), None, None, *rope, strided, caches[1], 4, 1e-6)


def _family_norms(n: int):
    """(formula, HF norm module of that formula): gpt-oss's and Gemma 4's fp32 weight, Qwen3.5's 1 + weight."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    return [("fp32_weight", GptOssRMSNorm(n, 1e-5)), ("fp32_weight", Gemma4RMSNorm(n, 1e-6)),
            ("fp32_one_plus_weight", Qwen3_5RMSNorm(n, 1e-6))]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_kernel_equals_the_fp32_weight_norms(interpret, dtype):
    """The norm kernel with the declared non-Llama formulas equals each family's own module (their weights
    random, rows of 256 and 100); the Llama formula on the same inputs does not."""
    gen = torch.Generator().manual_seed(4)
    for n in (256, 100):
        x = (torch.randn(2, 5, n, generator=gen) * 3).to(dtype)
        for formula, module in _family_norms(n):
            with torch.no_grad():
                module.weight.copy_(torch.rand(n, generator=gen) + 0.5)
            module.to(dtype)
            want = module(x)
            got = Norms(0.0, fast=False, kernel=True, formula=formula)(module, x)  # eps read off the module
            tol = 1e-6 if dtype == torch.float32 else 2e-3
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            llama = Norms(0.0, fast=False, kernel=True)(module, x)
            assert not torch.allclose(llama, want, atol=tol, rtol=tol) or formula == "fp32_weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_norm_kernel_equals_the_gated_delta_net_norm(interpret, dtype):
    """norm(x) * silu(z) in one kernel equals Qwen3.5's and Qwen3-Next's gated norm modules; without the gate
    it does not."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    gen = torch.Generator().manual_seed(5)
    for cls in (Qwen3_5RMSNormGated, Qwen3NextRMSNormGated):
        m = cls(128, eps=1e-6)
        with torch.no_grad():
            m.weight.copy_(torch.rand(128, generator=gen) + 0.5)
        m.to(dtype)
        x, z = ((torch.randn(6, 128, generator=gen) * 3).to(dtype) for _ in range(2))
        want = m(x, z)
        got = fused_ops.rms_norm(x, m.weight, m.variance_epsilon, gate=z)
        tol = 1e-6 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        assert not torch.allclose(fused_ops.rms_norm(x, m.weight, m.variance_epsilon), want, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_with_a_constant_after_equals_gemma_routers_input(interpret, dtype):
    """Gemma 4's router input, norm(x) * scale * H^-1/2 (a weightless norm, each product rounded), in one kernel:
    the Llama formula with the scale as its weight, then the constant (`post`); without it, it differs."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    gen = torch.Generator().manual_seed(6)
    n = 96
    x = (torch.randn(4, n, generator=gen) * 3).to(dtype)
    scale = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    want = Gemma4RMSNorm(n, 1e-6, with_scale=False)(x) * scale * n**-0.5
    got = fused_ops.rms_norm(x, scale, 1e-6, post=n**-0.5)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert not torch.allclose(fused_ops.rms_norm(x, scale, 1e-6), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_kernel_equals_the_static_formula(interpret, dtype):
    """weight * rms_norm(x), the norm rounded before the weight product; rows of 256 and of 100 (a partial
    tile). The fp32 sum, added in another order than torch's, may move a value by one rounding (rarely, in
    fp16)."""
    gen = torch.Generator().manual_seed(3)
    for n in (256, 100):
        x = (torch.randn(2, 5, n, generator=gen) * 3).to(dtype)
        w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
        want, got = w * F.rms_norm(x, (n,), eps=1e-6), fused_ops.rms_norm(x, w, 1e-6)
        assert got.shape == x.shape and got.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        if dtype == torch.float16:
            assert (got != want).sum() <= 0.01 * want.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "formula", [(False, 0.0), (True, 0.0), (True, 1.0)], ids=["llama", "fp32", "one-plus"]
)
def test_add_rms_norm_is_the_add_then_the_norm(interpret, dtype, formula):
    """The residual add rounded as torch's, then each norm formula on the sum; with a GEMV's partial sums (and a
    bias) as the delta, the sum is `gemv.gemv`'s output. A wrong delta row or a missing split fails."""
    fp32, offset = formula
    gen = torch.Generator().manual_seed(4)
    n = 100  # a partial tile
    x, delta = ((torch.randn(1, 3, n, generator=gen) * 3).to(dtype) for _ in range(2))
    w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    total, y = fused_ops.add_rms_norm(x, delta, w, 1e-6, fp32, offset)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(y, fused_ops.rms_norm(x + delta, w, 1e-6, fp32, offset), atol=tol, rtol=tol)
    row, k = x[:, :1], 300
    inp, bias = torch.randn(1, 1, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    wd = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    parts = gemv._gemv_parts(inp, wd, None, (8, 128, 4, 4, 1))  # several K slices
    assert parts.shape[0] > 1
    out = gemv._gemv_launch(inp, wd, bias, None, (8, 128, 4, 4, 1))
    total, y = fused_ops.add_rms_norm(row, parts, w, 1e-6, fp32, offset, parts=True, bias=bias)
    torch.testing.assert_close(total, row + out, atol=tol, rtol=tol)
    torch.testing.assert_close(y, fused_ops.rms_norm(row + out, w, 1e-6, fp32, offset), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="not of rows like"):
        fused_ops.add_rms_norm(x, parts, w, 1e-6, parts=True)


def test_scaled_parts_add_beside_the_first_group(interpret):  # noqa: F811
    """A second GEMV's partial sums scaled by sigmoid(logit) (`gemv_parts` with `scale`, a gated shared expert)
    and added with the first group's by `add_rms_norm(more=...)`: the sum of both outputs, gate applied."""
    gen = torch.Generator().manual_seed(6)
    n, k = 100, 300
    row, w = torch.randn(1, 1, n, generator=gen), torch.rand(n, generator=gen) + 0.5
    inp, gate = torch.randn(1, 1, k, generator=gen), torch.randn(1, 1, k, generator=gen)
    wa, wb = (torch.randn(n, k, generator=gen) / k**0.5 for _ in range(2))
    logit = torch.tensor([[-0.7]])
    first = gemv._gemv_parts(inp, wa, None, (8, 128, 4, 4, 1))
    second = gemv.gemv_parts(inp, wb, gate, logit)
    want = inp @ wa.T + torch.sigmoid(logit) * ((F.silu(gate) * inp) @ wb.T)
    total, y = fused_ops.add_rms_norm(row, first, w, 1e-6, parts=True, more=second)
    torch.testing.assert_close(total, row + want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, fused_ops.rms_norm(row + want, w, 1e-6), atol=1e-5, rtol=1e-5)
    without, _ = fused_ops.add_rms_norm(row, first, w, 1e-6, parts=True)
    assert not torch.allclose(without, total, atol=1e-3)  # the second group counts
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv_parts(inp.expand(1, 2, k), wb, None, logit)


def test_silu_mul_kernel_is_torch_on_strided_halves(interpret):
    """fp16, the two halves of one [rows, 2F] projection (strided rows): bitwise silu(gate) * up, rounded as
    torch rounds each op; F = 1,500 spans two column blocks."""
    gen = torch.Generator().manual_seed(4)
    for f in (64, 1500):
        gate, up = (torch.randn(1, 3, 2 * f, generator=gen) * 4).half().split(f, dim=-1)
        got = fused_ops.silu_mul(gate, up)
        assert got.shape == (1, 3, f) and torch.equal(got, F.silu(gate) * up)


@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_fast_path_with_split_kernels_equals_eager(interpret, model_type):
    """Every attention, the one-row o/down projections, and the elementwise work between GEMMs (norms, rotary,
    K/V writes, SwiGLU) through the kernels: tokens and drafts as the eager loop (fp32)."""
    adapter, drafter = _pair(model_type)
    cfg = GenerationConfig(max_new_tokens=12)
    flags = dict(decode_attention="split", block_attention="split", gemv=True, fused_ops=True)
    eng = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, **flags)
    prompt = _prompts(1)[0]
    eager, fast = _eager(adapter, drafter, prompt, cfg), eng.speculative(prompt, cfg)
    assert fast.output_ids == eager.output_ids == eng.autoregressive(prompt, cfg).output_ids
    n = _full_block_steps(eager, cfg.max_new_tokens)
    assert [s.proposed for s in fast.steps[:n]] == [s.proposed for s in eager.steps[:n]]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_few_row_kernel_steps_equal_eager(interpret, model_type, monkeypatch):
    """`gemv_rows=16` (`DFLASH_ZOO_GEMV_ROWS=16`): the verify, draft and context projections of the target and
    the drafter (and a hybrid's GDN input projections) run the few-row kernel; tokens and drafts stay the eager
    loop's (fp32)."""
    adapter, drafter = _pair(model_type)
    cfg = GenerationConfig(max_new_tokens=12)
    flags = dict(decode_attention="split", block_attention="split", gemv=True, fused_ops=True, gemv_rows=16)
    eng = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, **flags)
    prompt = _prompts(1)[0]
    calls, real = [], gemv._gemv_parts
    monkeypatch.setattr(gemv, "_gemv_parts", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    eager, fast = _eager(adapter, drafter, prompt, cfg), eng.speculative(prompt, cfg)
    assert fast.output_ids == eager.output_ids
    n = _full_block_steps(eager, cfg.max_new_tokens)
    assert [s.proposed for s in fast.steps[:n]] == [s.proposed for s in eager.steps[:n]]
    assert any(shape[-2] == 8 for shape in calls)  # block-wide rows went through the kernel


def test_custom_ops_trace_under_torch_compile(interpret):
    """The ops' fake (meta) functions give the shapes the real ones do: `torch.compile` traces all five ops in
    one graph (aot_eager: dynamo, fake tensors and functionalization, then eager kernels) with the same result
    and the same cache writes."""
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(1, (4 + 2 * 2) * 16, generator=gen)
    k, v = (torch.randn(2, 64, 16, generator=gen) for _ in range(2))
    cos, sin, pos = torch.ones(1, 16), torch.zeros(1, 16), torch.tensor([30])
    gmask = group_mask(torch.arange(64)[None, :] <= torch.tensor([[30]]), 2, torch.float32)
    w = torch.randn(24, 64, generator=gen)
    gate, scale = torch.randn(1, 1, 64, generator=gen), torch.randn(1, 1, 24, generator=gen)

    def step(qkv, k, v, gmask, w, gate, scale):  # attention [1, 1, 64], a SwiGLU-style down projection to 24
        q = fused_ops.rope_store(qkv, None, None, cos, sin, pos, k, v, 4, 1e-6)  # [4, 1, 16]; k, v row 30 set
        att = fused_ops.rms_norm(grouped_split(q[None], k[None], v[None], gmask, 0.25), w[0], 1e-6)
        out = gemv.gemv(att, w, None, fused_ops.silu_mul(gate, att))
        return out * scale  # a [1, 1, 24] operand: a wrong fake shape fails the trace

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    caches = [(k.clone(), v.clone()) for _ in range(2)]
    want = step(qkv, *caches[0], gmask, w, gate, scale)
    torch.testing.assert_close(compiled(qkv, *caches[1], gmask, w, gate, scale), want)
    assert not torch.equal(caches[0][0], k)  # the write happened, and the same under compile
    torch.testing.assert_close(caches[1], caches[0])


def test_split_attention_off_cuda_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    adapter, drafter = _pair("qwen3")
    with pytest.raises(ValueError, match="block_attention='split': the Triton kernels need a CUDA device"):
        fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, block_attention="split")
    with pytest.raises(ValueError, match="block_attention must be one of"):
        fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, block_attention="sums")
    with pytest.raises(ValueError, match="gemv: the Triton kernels need a CUDA device"):
        fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, gemv=True)
    with pytest.raises(ValueError, match="fused_ops: the Triton kernels need a CUDA device"):
        fast_engine(adapter, drafter, MASK, max_len=64, graphs=False, fused_ops=True)


@pytest.mark.parametrize("compile", [False, True])
def test_kernel_defaults_on_cuda_and_the_escape_hatch(monkeypatch, compile):
    """On a CUDA device with triton the kernels are the default; `kernels=False` (DFLASH_ZOO_KERNELS=0) restores
    the previous paths; explicit choices stand either way; CPU never picks them (no device is touched here)."""
    pytest.importorskip("triton")
    from dflash_zoo.cuda.static.kernel_choice import COMPILED_DECODE_ATTENTION, choose_kernels
    from dflash_zoo.engine.options import FastOptions

    def choice(device, env=None, **chosen):
        k = choose_kernels(device, FastOptions.from_env(env or {}, compile=compile, **chosen))
        return k.decode_attention, k.block_attention, k.gemv, k.fused_ops

    cuda = torch.device("cuda")
    # fused_ops only uncompiled: compiled, inductor fuses those ops itself
    assert choice(cuda) == ("split", "split", True, not compile)
    explicit = dict(decode_attention="sdpa", block_attention="sdpa", gemv=False, fused_ops=False)
    assert choice(cuda, **explicit) == ("sdpa", "sdpa", False, False)
    assert choice(cuda, fused_ops=True)[3]
    off = {"DFLASH_ZOO_KERNELS": "0"}
    plain = (COMPILED_DECODE_ATTENTION if compile else "sdpa", "sdpa", False, False)
    assert choice(cuda, off) == plain
    assert choice(cuda, off, block_attention="split", gemv=True, fused_ops=True) == (
        plain[0],
        "split",
        True,
        True,
    )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choice(torch.device("cpu")) == plain


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("case", CASES + [(8, 4, 128, 1152, 700), (8, 64, 128, 1152, 700)], ids=str)
def test_split_attention_bf16_on_cuda(case):
    q, k, v, bias = _case(*case, torch.bfloat16, "cuda")
    ref = _reference(q, k, v, bias, 0.125)
    out = attn_ops.split_kv_attention(q, k, v, bias, 0.125)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.125)
    # no further from the fp32 reference than bf16 SDPA is, give or take a bf16 rounding of the output
    assert (out.float() - ref).abs().max() <= (sdpa.float() - ref).abs().max() + 2**-7


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("case", ROPE_CASES + [(32, 8, 128, 128, 16, True)], ids=str)
def test_rope_store_bf16_on_cuda(case):
    """bf16 on the GPU: the rotary alone is bitwise torch's; with the norm, whose fp32 sum runs in another
    order than torch's rms_norm kernel, a rounding or two apart, and rarely (cancellation in the rotary sum
    keeps the bound absolute)."""
    got, caches, want, ref_caches = _rope_both(_rope_case(case, torch.bfloat16, "cuda"))
    assert torch.equal(caches[1], ref_caches[1])
    for a, b in ((got, want), (caches[0], ref_caches[0])):
        if not case[5]:
            assert torch.equal(a, b)
        else:
            diff = (a.float() - b.float()).abs()
            assert (diff <= 2**-6 * (1 + b.float().abs())).all() and (diff > 0).sum() <= 0.02 * diff.numel()


@pytest.mark.gpu
@CUDA
def test_rms_norm_and_silu_mul_bf16_on_cuda():
    """bf16 on the GPU, against the torch ops they replace: a value may move by one rounding, rarely (the norm's
    fp32 sum order; Triton's exp in SiLU)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(16, 4096, generator=gen) * 3).to("cuda", torch.bfloat16)
    w = (torch.rand(4096, generator=gen) + 0.5).to("cuda", torch.bfloat16)
    gate, up = (torch.randn(16, 2 * 12288, generator=gen) * 4).to("cuda", torch.bfloat16).split(12288, dim=-1)
    pairs = [
        (fused_ops.rms_norm(x, w, 1e-6), w * F.rms_norm(x, (4096,), eps=1e-6)),
        (fused_ops.silu_mul(gate, up), F.silu(gate) * up),
    ]
    for got, want in pairs:
        diff = (got.float() - want.float()).abs()
        assert (diff <= 2**-7 * want.float().abs() + 1e-6).all() and (diff > 0).sum() <= 0.01 * diff.numel()


def test_tuning_is_on_for_cuda_tensors_unless_switched_off(monkeypatch):
    from dflash_zoo.engine.options import FastOptions

    cuda_like, cpu = types.SimpleNamespace(is_cuda=True), torch.zeros(1)
    monkeypatch.setattr(
        torch.cuda, "is_current_stream_capturing", lambda: False
    )  # a CPU torch has no streams
    assert runtime.tunes(cuda_like) and not runtime.tunes(cpu)
    assert not runtime.tunes(cuda_like, tune=False)
    assert FastOptions.from_env({"DFLASH_ZOO_TUNE": "0"}).tune is False  # the switch users set
    assert FastOptions.from_env({"DFLASH_ZOO_TUNE": "1"}).tune and FastOptions.from_env({}).tune


@pytest.mark.gpu
@CUDA
def test_untuned_kernels_take_their_first_config_on_cuda():
    x, w = torch.randn(1, 1, 384, device="cuda"), torch.randn(200, 384, device="cuda")
    tuned = dict(gemv._tuned)
    assert gemv._gemv_config(x, w, None, tune=False) == gemv.GEMV_CONFIGS[0] and gemv._tuned == tuned


@pytest.mark.gpu
@CUDA
def test_gemv_bf16_on_cuda_is_tuned_and_close():
    """The tuner times every config once per shape; the fused SiLU input is rounded as torch's; the result is
    as close to fp32 as cuBLAS's bf16 GEMV is."""
    for rows, (n, k) in itertools.product((1, 16), [(4096, 12288), (4096, 4096), (100, 300)]):
        x, gate = (torch.randn(1, rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        inp = F.silu(gate) * x
        ref = F.linear(inp.float(), w.float())
        out = gemv.gemv(x, w, None, gate)
        config = gemv._tuned[((n, k), torch.bfloat16, 1, False, rows, x.device, False)]
        assert torch.equal(out, gemv._gemv_launch(inp, w, None, None, config))  # same tiles, same sums
        assert (out.float() - ref).abs().max() <= (F.linear(inp, w).float() - ref).abs().max() + 2**-6


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("model_type", STATIC_MODEL_TYPES)
def test_split_kernels_graphed_engine_equals_eager_fp32(model_type, compile):
    adapter, drafter = _pair(model_type, "cuda")
    _capturable(adapter)
    flags = dict(decode_attention="split", block_attention="split", gemv=True)
    eng = fast_engine(adapter, drafter, MASK, 64, graphs=True, compile=compile, **flags)
    _assert_both_paths_equal_ar(eng, adapter, GenerationConfig(max_new_tokens=24), "cuda")


@pytest.mark.gpu
@CUDA
def test_fp32_weight_and_gated_norms_bf16_on_cuda():
    """The non-Llama norm formulas in bf16 on the GPU: as close to each family's module as one rounding."""
    for formula, module in _family_norms(4096):
        module.cuda().to(torch.bfloat16)
        x = torch.randn(16, 4096, device="cuda").to(torch.bfloat16) * 3
        got = Norms(0.0, fast=False, kernel=True, formula=formula)(module, x)
        assert (got.float() - module(x).float()).abs().max() <= 2**-6 * module(x).float().abs().max()


def _nucleus_reference(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rule by its definition: token i stays when the mass strictly above p_i is below top_p."""
    above = torch.stack([(row[None, :] * (row[None, :] > row[:, None])).sum(-1) for row in p])  # [R, V]
    return torch.where(above < top_p, p, torch.zeros_like(p))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999])
def test_nucleus_kernel_and_sorted_rule_keep_the_defined_set(interpret, top_p):
    """The sort-free CUDA kernel and the CPU path keep exactly the tokens the rule names, ties together
    (logits rounded to halves make tie groups that straddle the top_p boundary)."""
    from dflash_zoo.cuda.ops.nucleus import nucleus_mask
    from dflash_zoo.engine.sampling import nucleus

    gen = torch.Generator().manual_seed(5)
    for vocab in (300, 2500):  # one chunk per row, and several
        x = (torch.randn(6, vocab, generator=gen) * 2).mul(2).round().div(2)
        x[0] = 0.0  # one row of all ties: everything stays
        p = x.softmax(-1)
        want = _nucleus_reference(p, top_p)
        kept = nucleus_mask(p, top_p)
        assert torch.equal(kept > 0, want > 0) and torch.equal(kept, want)
        assert (kept[0] > 0).all() and ((want > 0).sum(-1) >= 1).all()
        cpu = nucleus(p, top_p)
        assert torch.equal(cpu > 0, want > 0)
        torch.testing.assert_close(cpu, want / want.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match="fp32"):
        nucleus_mask(p.half(), 0.9)


@pytest.mark.gpu
@CUDA
def test_add_rms_norm_and_gemv_parts_bf16_on_cuda():
    """bf16 on the GPU: the fused residual add is torch's add bitwise; the norm and the summed partials of a
    tuned GEMV are within a rounding of `rms_norm` over `gemv`'s output."""
    gen = torch.Generator("cuda").manual_seed(6)
    n, k = 4096, 12288
    x, delta = (torch.randn(1, 16, n, generator=gen, device="cuda").bfloat16() for _ in range(2))
    w = (torch.rand(n, generator=gen, device="cuda") + 0.5).bfloat16()
    total, y = fused_ops.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(total, x + delta)
    want = fused_ops.rms_norm(x + delta, w, 1e-6)
    assert ((y.float() - want.float()).abs() <= 2**-7 * want.float().abs() + 1e-6).all()
    row, up, gate = (torch.randn(1, 1, s, generator=gen, device="cuda").bfloat16() for s in (n, k, k))
    wd = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).bfloat16()
    parts = gemv.gemv_parts(up, wd, gate)
    total, y = fused_ops.add_rms_norm(row, parts, w, 1e-6, parts=True)
    ref = row + gemv._gemv_launch(
        up, wd, None, gate, gemv._tuned[((n, k), torch.bfloat16, 1, True, 1, row.device, False)]
    )
    assert ((total.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-6).all()


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_nucleus_on_cuda_keeps_the_sorted_rule_set(top_p):
    """16 rows of a 151,936-token vocabulary on the GPU: the sort-free kernel keeps the set the sorted CPU
    rule keeps, for peaked and for nearly flat rows."""
    from dflash_zoo.engine.sampling import nucleus

    gen = torch.Generator("cuda").manual_seed(7)
    x = torch.randn(16, 151_936, generator=gen, device="cuda")
    x[8:] *= 0.05  # nearly flat: the nucleus holds most of the vocabulary
    p = (x * 4).softmax(-1)
    got, want = nucleus(p, top_p), nucleus(p.cpu(), top_p)
    assert torch.equal((got > 0).cpu(), want > 0)
    torch.testing.assert_close(got.cpu(), want)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("t", [1, 16])
def test_split_attention_with_sinks_on_cuda(t):
    """The compiled merge with sinks: fp32 as the explicit sink softmax (gpt-oss's 64 heads over 8 K/V heads)."""
    gen = torch.Generator("cuda").manual_seed(t)
    q = torch.randn(1, 64, t, 64, generator=gen, device="cuda")
    k, v = (torch.randn(1, 8, 1152, 64, generator=gen, device="cuda") for _ in range(2))
    pos = torch.arange(700, 700 + t, device="cuda")[:, None]
    seen = (torch.arange(1152, device="cuda")[None, :] <= pos) & (
        pos - torch.arange(1152, device="cuda") < 128
    )
    gmask = group_mask(seen, 8, torch.float32)
    sinks = torch.randn(64, generator=gen, device="cuda") * 3
    torch.testing.assert_close(
        grouped_split(q, k, v, gmask, 0.125, sinks),
        grouped_sinks(q, k, v, gmask, 0.125, sinks),
        atol=2e-5,
        rtol=2e-5,
    )
