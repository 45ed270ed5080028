"""The expert GEMV of cuda/moe.py: a sparse block's routed experts, pair by pair, against the experts module's
own forward (every MoE family with a static layout: plain, biased and transposed, interleaved gate/up,
shared experts, a router with extra arguments), and inside the static engine for one-row and verify steps.

CPU runs the kernel under Triton's interpreter (fp32); the GPU test covers bf16 in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from dflash_zoo.cuda import moe
from dflash_zoo.cuda.fast import FastEngine
from dflash_zoo.cuda.layout import resolve
from dflash_zoo.engine.results import GenerationConfig
from tests.static_matrix import STATIC_MODEL_TYPES, static_pair
from tests.test_fast import MASK, _eager, _prompts
from tests.test_kernels import interpret  # noqa: F401  (fixture)


def _sparse_layers(adapter):
    """(resolved layer, its MLP module) of every sparse layer whose experts the GEMV runs."""
    return [(m, m.mlp) for m in resolve(adapter).layers if m.moe_parts is not None]


MOE_TYPES = [t for t in STATIC_MODEL_TYPES if _sparse_layers(static_pair(t)[0])]


def test_the_matrix_has_moe_families_of_every_kind():
    """plain (qwen3_moe), biased + transposed + interleaved with its own router (gpt_oss), shared experts
    (qwen3_5_moe*), a router with an extra argument (minimax_m2)."""
    assert {"qwen3_moe", "gpt_oss", "qwen3_5_moe_text", "minimax_m2"} <= set(MOE_TYPES)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_routed_experts_equal_the_module(interpret, model_type, rows):  # noqa: F811
    adapter, _ = static_pair(model_type)
    m, block = _sparse_layers(adapter)[0]
    router, args, experts, _, _ = m.moe_parts
    x = torch.randn(rows, adapter.text_config.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        _, weights, index = router(x, *args)
        want = experts(x, index, weights)
        got = moe.routed(experts, x, index, weights)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_a_wrong_expert_is_caught(interpret, model_type):  # noqa: F811
    """The comparison above can fail: routing every pair to another expert changes the output."""
    adapter, _ = static_pair(model_type)
    router, args, experts, _, _ = _sparse_layers(adapter)[0][0].moe_parts
    x = torch.randn(1, adapter.text_config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, weights, index = router(x, *args)
        wrong = (index + 1) % experts.gate_up_proj.shape[0]
        assert not torch.allclose(moe.routed(experts, x, wrong, weights), experts(x, index, weights), atol=1e-4)


@pytest.mark.parametrize("moe_rows", [1, pytest.param(16, marks=pytest.mark.slow)])  # 16: ~15 s each
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_engine_with_the_expert_gemv_equals_eager(interpret, model_type, moe_rows):  # noqa: F811
    """One-row steps (the default), and verify steps too: tokens and drafts as the eager loop (fp32)."""
    adapter, drafter = static_pair(model_type)
    cfg = GenerationConfig(max_new_tokens=12)
    eng = FastEngine(adapter, drafter, MASK, max_len=48, graphs=False, moe_rows=moe_rows)
    prompt = _prompts(1)[0]
    eager, fast = _eager(adapter, drafter, prompt, cfg), eng.speculative(prompt, cfg)
    assert fast.output_ids == eager.output_ids == eng.autoregressive(prompt, cfg).output_ids
    assert [s.proposed for s in fast.steps] == [s.proposed for s in eager.steps]


def test_moe_rows_off_cuda_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    adapter, drafter = static_pair("qwen3_moe")
    with pytest.raises(ValueError, match="moe_rows"):
        FastEngine(adapter, drafter, MASK, max_len=48, graphs=False, moe_rows=1)
    assert FastEngine(adapter, drafter, MASK, max_len=48, graphs=False).moe_rows == 0  # off by default on CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_expert_gemv_bf16_on_cuda_is_close_and_captures(model_type):
    adapter, _ = static_pair(model_type, "cuda")
    adapter.model.to(torch.bfloat16)
    router, args, experts, _, _ = _sparse_layers(adapter)[0][0].moe_parts
    x = torch.randn(1, adapter.text_config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, weights, index = router(x, *args)
        ref = experts.float()(x.float(), index, weights.float())
        experts.to(torch.bfloat16)
        got = moe.routed(experts, x, index, weights)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = moe.routed(experts, x, index, weights)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, got)
    assert (got.float() - ref).norm() / ref.norm() < 2e-2


@pytest.mark.slow  # ~15 s
def test_gemma4_experts_beside_the_dense_mlp_through_the_gemv(interpret):  # noqa: F811
    """Gemma 4 26B-A4B's parallel branch (router and experts children of the decoder layer) takes the expert
    GEMV too: tokens and drafts as the eager loop, and the experts equal their module."""
    from tests.test_static_families import GEMMA_VARIANTS

    adapter, drafter = static_pair("gemma4", **GEMMA_VARIANTS["moe_branch"])
    eng = FastEngine(adapter, drafter, MASK, max_len=48, graphs=False, moe_rows=16)
    router, experts = eng.target.layers[0].moe_branch[:2]
    x = torch.randn(3, adapter.text_config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, weights, index = router(x)
        torch.testing.assert_close(moe.routed(experts, x, index, weights), experts(x, index, weights))
    cfg = GenerationConfig(max_new_tokens=12)
    prompt = _prompts(1)[0]
    eager, fast = _eager(adapter, drafter, prompt, cfg), eng.speculative(prompt, cfg)
    assert fast.output_ids == eager.output_ids
    assert [s.proposed for s in fast.steps] == [s.proposed for s in eager.steps]
