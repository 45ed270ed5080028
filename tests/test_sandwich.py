"""The sandwich-norm residual kernel (cuda/ops/sandwich.py) against Gemma 4's modules and torch ops."""

from __future__ import annotations

import pytest
import torch

from dflash_zoo.cuda.ops import sandwich
from tests.test_kernels import interpret  # noqa: F401  (the fixture)


def _gemma_norms(n: int, count: int, dtype, gen):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    norms = [Gemma4RMSNorm(n, 1e-6) for _ in range(count)]
    with torch.no_grad():
        for m in norms:
            m.weight.copy_(torch.rand(n, generator=gen) + 0.5)
    return [m.to(dtype) for m in norms]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parts", [False, True], ids=["tensor", "parts"])
def test_sandwich_add_around_the_mlp_equals_gemma4s_layer_ops(interpret, dtype, parts):  # noqa: F811
    """x -> (x + norm_o(norm_1(dense) + norm_2(experts))) * scalar and the next layer's input norm, as Gemma 4's
    decoder layer computes them with its modules (the branch outputs given as partial sums or as tensors)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    gen = torch.Generator().manual_seed(0)
    rows, n = 3, 80
    n1, n2, no, nxt = _gemma_norms(n, 4, dtype, gen)
    x = (torch.randn(rows, n, generator=gen) * 2).to(dtype)
    s1 = torch.randn(
        4, rows, n, generator=gen
    )  # fp32 partial sums: the dense down GEMV's, the experts' slices
    s2 = torch.randn(2, rows, n, generator=gen)
    dense, routed = s1.sum(0).to(dtype), s2.sum(0).to(dtype)
    scalar = torch.tensor([0.75], dtype=dtype)
    with torch.no_grad():
        want_x = (x + no(n1(dense) + n2(routed))) * scalar
        want_y = nxt(want_x)
    d1, d2 = (s1, s2) if parts else (dense, routed)
    got_x, got_y = sandwich.sandwich_add(x, d1, n1.weight, [nxt.weight], 1e-6, parts1=parts, d2=d2, w2=n2.weight,
                                         parts2=parts, outer=no.weight, scalar=scalar)  # fmt: skip
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(got_x, want_x, **tol)
    torch.testing.assert_close(got_y[0], want_y, **tol)
    without_outer = sandwich.sandwich_add(x, d1, n1.weight, [], 1e-6, parts1=parts, d2=d2, w2=n2.weight, parts2=parts,
                                          scalar=scalar)[0]  # fmt: skip
    assert not torch.allclose(without_outer.float(), want_x.float(), atol=1e-2)
    assert isinstance(nxt, Gemma4RMSNorm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sandwich_add_around_attention_gives_the_mlp_and_router_inputs(interpret, dtype):  # noqa: F811
    """x + norm_a(o) and its three norms: the MLP's and the experts' input norms, and the router's input (a
    weightless norm times its scale times H^-1/2, Llama's rounding), as Gemma 4's modules compute them."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    gen = torch.Generator().manual_seed(1)
    rows, n = 2, 64
    na, pre, pre2 = _gemma_norms(n, 3, dtype, gen)
    scale = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    x, o = ((torch.randn(rows, n, generator=gen) * 2).to(dtype) for _ in range(2))
    with torch.no_grad():
        want_x = x + na(o)
        router_in = Gemma4RMSNorm(n, 1e-6, with_scale=False)(want_x) * scale * n**-0.5
        want = [pre(want_x), pre2(want_x), router_in]
    got_x, got_y = sandwich.sandwich_add(x, o, na.weight, [pre.weight, pre2.weight, scale], 1e-6, last_llama=True,
                                         post=n**-0.5)  # fmt: skip
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(got_x, want_x, **tol)
    for got, w in zip(got_y, want, strict=True):
        torch.testing.assert_close(got, w, **tol)


def test_sandwich_add_rejects_mismatched_inputs(interpret):  # noqa: F811
    x, w = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="partial sums"):
        sandwich.sandwich_add(x, torch.zeros(3, 1, 8), w, [], 1e-6, parts1=True)
    with pytest.raises(ValueError, match="shaped like the residual"):
        sandwich.sandwich_add(x, torch.zeros(2, 4), w, [], 1e-6)
    with pytest.raises(ValueError, match="norm weight"):
        sandwich.sandwich_add(x, x, w, [], 1e-6, d2=x)
    with pytest.raises(ValueError, match="output norms"):
        sandwich.sandwich_add(x, x, w, [w] * 4, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["k_eq_v", "moe_branch"])
def test_gemma4_31b_and_26b_layouts_graphed_on_cuda_fp32(variant):
    """The Gemma 4 31B / 26B-A4B layouts (K = V global layers; the experts beside the dense MLP) through every
    kernel on the GPU, CUDA graphs on, fp32: the sandwich kernel runs every layer, and speculative and
    autoregressive decoding equal plain greedy decoding."""
    from dflash_zoo.engine.results import GenerationConfig
    from tests.static_matrix import fast_engine, static_pair
    from tests.test_fast import _assert_both_paths_equal_ar
    from tests.test_static_families import GEMMA_VARIANTS, MASK

    adapter, drafter = static_pair("gemma4", "cuda", **GEMMA_VARIANTS[variant])
    adapter.model.set_experts_implementation("batched_mm")  # fp32 `grouped_mm` would sync (the prefill's)
    eng = fast_engine(adapter, drafter, MASK, 64, graphs=True, fused_ops=True, gemv=True, moe_rows=16)
    assert all(eng.target.sandwich)
    _assert_both_paths_equal_ar(eng, adapter, GenerationConfig(max_new_tokens=24), "cuda")
