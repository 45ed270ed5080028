"""The kernels of cuda/ops/moe.py (run by cuda/static/moe.py): a sparse block's routing rule against its router module, and its routed experts,
pair by pair, against the experts module's own forward (every MoE family with a static layout: plain, biased
and transposed, interleaved and clamped gate/up, shared experts, a router with extra arguments), with the
declared activation in the down kernel and without; and inside the static engine for one-row and verify steps.

CPU runs the kernel under Triton's interpreter (fp32); the GPU test covers bf16 in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from dflash_zoo.cuda.ops import moe
from dflash_zoo.cuda.static import moe as static_moe
from dflash_zoo.cuda.static.layout import resolve
from dflash_zoo.cuda.static.layout_moe import ExpertGate
from dflash_zoo.cuda.static.linear import Parts
from dflash_zoo.engine.results import GenerationConfig
from tests.static_matrix import STATIC_MODEL_TYPES, fast_engine, static_pair
from tests.test_fast import MASK, _eager, _prompts
from tests.test_kernels import interpret  # noqa: F401  (fixture)


def _sparse_layers(adapter):
    """(resolved layer, its MLP module) of every sparse layer whose experts the GEMV runs."""
    return [(m, m.mlp) for m in resolve(adapter).layers if m.moe_parts is not None]


def _first_block(model_type: str, device: str = "cpu"):
    """(the tiny target's adapter, the parts of its first sparse block)."""
    adapter, _ = static_pair(model_type, device)
    return adapter, _sparse_layers(adapter)[0][0].moe_parts


MOE_TYPES = [t for t in STATIC_MODEL_TYPES if _sparse_layers(static_pair(t)[0])]
ROUTED_TYPES = [t for t in MOE_TYPES if _first_block(t)[1].routing is not None]


def test_the_matrix_has_moe_families_of_every_kind():
    """plain (qwen3_moe), biased + transposed + interleaved with its own router (gpt_oss), shared experts
    (qwen3_5_moe*), a router with an extra argument (minimax_m2)."""
    assert {"qwen3_moe", "gpt_oss", "qwen3_5_moe_text", "minimax_m2"} <= set(MOE_TYPES)


def test_the_declared_rules_cover_every_kind():
    """Each declared routing rule and fused activation is exercised by some family of the matrix."""
    parts = [_first_block(t)[1] for t in MOE_TYPES]
    assert {p.routing.rule for p in parts if p.routing} == {"softmax_topk", "topk_softmax"}
    # qwen3_moe's tiny config leaves its top k unnormalised (norm_topk_prob false), the others renormalise
    assert {p.routing.renormalize for p in parts if p.routing and p.routing.rule == "softmax_topk"} == {
        True,
        False,
    }
    assert {p.gate.kind for p in parts if p.gate} == {"silu", "clamped_swiglu"}
    assert any(p.routing is None for p in parts) and any(p.gate is None for p in parts)  # modules run too


def _inputs(adapter, rows: int, seed: int, scale: float = 1.0):
    return scale * torch.randn(
        rows, adapter.text_config.hidden_size, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_routed_experts_equal_the_module(interpret, model_type, rows):  # noqa: F811
    """With the module's activation between the projections and with the declared one in the down kernel; x
    scaled up too, so that gpt-oss's clamps bite."""
    adapter, p = _first_block(model_type)
    for scale in (1.0, 30.0):
        x = _inputs(adapter, rows, rows, scale)
        with torch.no_grad():
            _, weights, index = p.router(x, *p.router_args)
            want = p.experts(x, index, weights)
            for gate in {None, p.gate}:
                got = static_moe.routed(p.experts, x, index, weights, gate)
                assert got.shape == want.shape and got.dtype == want.dtype
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("model_type", ROUTED_TYPES)
def test_routing_kernel_equals_the_router(interpret, model_type, rows):  # noqa: F811
    adapter, p = _first_block(model_type)
    x = _inputs(adapter, rows, 7)
    with torch.no_grad():
        logits, want_w, want_i = p.router(x, *p.router_args)
        w, i = moe.route(logits, p.routing.top_k, p.routing.rule, p.routing.renormalize)
        assert torch.equal(i, want_i)
        torch.testing.assert_close(w, want_w)
        # the comparison can fail: weights not renormalised (or renormalised where they were not) differ; a
        # renormalised softmax_topk equals topk_softmax (softmax over the top k), so that is no counter-example
        flip = not p.routing.renormalize if p.routing.rule == "softmax_topk" else False
        assert not torch.allclose(moe.route(logits, p.routing.top_k, "softmax_topk", flip)[0], want_w)
    with pytest.raises(ValueError, match="routing rule"):
        moe.route(logits, 2, "sigmoid", True)
    scale = torch.rand(logits.shape[1], generator=torch.Generator().manual_seed(3)).to(logits.dtype) + 0.5
    scaled, si = moe.route(logits, p.routing.top_k, "softmax_topk", True, scale)  # Gemma 4: per-expert scales
    renormed = moe.route(logits.float(), p.routing.top_k, "softmax_topk", True)[0]
    assert torch.equal(si, i) and scaled.dtype == torch.float32
    torch.testing.assert_close(scaled, renormed * scale[si].float())
    with pytest.raises(ValueError, match="expert scales"):
        moe.route(logits, 2, "softmax_topk", True, scale[:-1])
    sums = torch.randn(3, *logits.shape, generator=torch.Generator().manual_seed(4))  # a GEMV's partial sums
    from_parts = moe.route(sums, p.routing.top_k, "softmax_topk", True, scale, parts=True)
    from_sum = moe.route(sums.sum(0).to(scale.dtype), p.routing.top_k, "softmax_topk", True, scale)
    assert torch.equal(from_parts[1], from_sum[1]) and torch.equal(from_parts[0], from_sum[0])
    with pytest.raises(ValueError, match="go with expert scales"):
        moe.route(sums, 2, "softmax_topk", True, parts=True)


def test_routing_picks_the_top_k_in_order_and_breaks_ties_low(interpret):  # noqa: F811
    logits = torch.tensor([[0.5, 3.0, -1.0, 3.0, 2.0, 0.0]])
    w, i = moe.route(logits, 3, "topk_softmax", False)
    assert i.tolist() == [[1, 3, 4]]  # descending; of the equal logits the lower id first
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[3.0, 3.0, 2.0]]), -1))
    w, i = moe.route(logits, 2, "softmax_topk", True)
    assert i.tolist() == [[1, 3]] and torch.allclose(w, torch.tensor([[0.5, 0.5]]))


@pytest.mark.parametrize("rows", [16, 5])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_rows_sharing_their_experts(interpret, model_type, rows):  # noqa: F811
    """Several rows (the grouped kernel): every row on the same two experts (16 rows of one expert in one
    program), and rows whose experts repeat in another order."""
    adapter, p = _first_block(model_type)
    x = _inputs(adapter, rows, 3)
    weights = torch.softmax(torch.randn(rows, 2, generator=torch.Generator().manual_seed(4)), -1)
    same = torch.tensor([[2, 0]]).repeat(rows, 1)
    mixed = torch.tensor([[1, 3], [3, 1], [0, 1], [2, 3], [1, 0]]).repeat(4, 1)[:rows]
    with torch.no_grad():
        for index in (same, mixed):
            want = p.experts(x, index, weights)
            torch.testing.assert_close(
                static_moe.routed(p.experts, x, index, weights, p.gate), want, rtol=1e-5, atol=1e-5
            )


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_a_wrong_expert_is_caught(interpret, model_type, rows):  # noqa: F811
    """The comparison above can fail: routing every pair to another expert changes the output."""
    adapter, p = _first_block(model_type)
    x = _inputs(adapter, rows, 0)
    with torch.no_grad():
        _, weights, index = p.router(x, *p.router_args)
        wrong = (index + 1) % p.experts.gate_up_proj.shape[0]
        want = p.experts(x, index, weights)
        assert not torch.allclose(static_moe.routed(p.experts, x, wrong, weights, p.gate), want, atol=1e-4)


@pytest.mark.parametrize("moe_rows", [1, pytest.param(16, marks=pytest.mark.slow)])  # 16: ~15 s each
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_engine_with_the_expert_gemv_equals_eager(interpret, model_type, moe_rows):  # noqa: F811
    """One-row steps (the default), and verify steps too: tokens and drafts as the eager loop (fp32)."""
    adapter, drafter = static_pair(model_type)
    cfg = GenerationConfig(max_new_tokens=12)
    eng = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, moe_rows=moe_rows)
    prompt = _prompts(1)[0]
    eager, fast = _eager(adapter, drafter, prompt, cfg), eng.speculative(prompt, cfg)
    assert fast.output_ids == eager.output_ids == eng.autoregressive(prompt, cfg).output_ids
    assert [s.proposed for s in fast.steps] == [s.proposed for s in eager.steps]


def test_one_row_experts_are_summed_by_the_next_norm(interpret, monkeypatch):  # noqa: F811
    """With the norm kernels on, a one-row step's weighted expert slices go to the next residual add unsummed
    (`Parts`) where nothing reads the layer's output before it; tokens stay the eager loop's (fp32)."""
    adapter, drafter = static_pair("gpt_oss")  # the top-k-then-softmax rule and the clamped gate, in kernels
    eng = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, gemv=True, fused_ops=True)
    assert any(eng.target.fold_down) and not all(eng.target.fold_down)  # tap layers keep their sums
    seen, real = [], static_moe.routed_parts
    monkeypatch.setattr(
        static_moe, "routed_parts", lambda *a, **k: seen.append(a[1].shape[0]) or real(*a, **k)
    )
    cfg = GenerationConfig(max_new_tokens=6)
    prompt = _prompts(1)[0]
    assert eng.autoregressive(prompt, cfg).output_ids == _eager(adapter, drafter, prompt, cfg).output_ids
    # every one-row step, and the short prompt (at most moe_rows rows; longer prefills run the module's experts)
    sparse = sum(m.moe_parts is not None for m in eng.target.layers)
    assert seen.count(1) == (cfg.max_new_tokens - 1) * sparse and max(seen) <= eng.kernels.moe_rows


@pytest.mark.parametrize("rows", [1, 3])
def test_moe_ops_trace_under_torch_compile(interpret, rows):  # noqa: F811
    """The fake functions of `route` and `expert_linear` give the real shapes: the routing kernel and both
    expert kernels (one token, several) trace in one graph (aot_eager) with the same result."""
    adapter, p = _first_block("gpt_oss")
    w, b = p.router.weight, p.router.bias

    def block(x):
        weights, index = moe.route(x @ w.T + b, p.routing.top_k, p.routing.rule, p.routing.renormalize)
        return (
            static_moe.routed_parts(p.experts, x, index, weights, p.gate).sum(0) * 2
        )  # a wrong fake shape fails

    x = _inputs(adapter, rows, 5)
    with torch.no_grad():
        want = block(x)
        torch.testing.assert_close(torch.compile(block, backend="aot_eager", fullgraph=True)(x), want)
        _, weights, index = p.router(x)
        torch.testing.assert_close(want, 2 * p.experts(x, index, weights), rtol=1e-5, atol=1e-5)


def test_moe_rows_off_cuda_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    adapter, drafter = static_pair("qwen3_moe")
    with pytest.raises(ValueError, match="moe_rows"):
        fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, moe_rows=1)
    eng = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False)
    assert eng.kernels.moe_rows == 0  # off by default on CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_expert_gemv_bf16_on_cuda_is_close_and_captures(model_type, rows):
    adapter, p = _first_block(model_type, "cuda")
    adapter.model.to(torch.bfloat16)  # in place: the resolved parts are the same modules
    x = torch.randn(rows, adapter.text_config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        logits, weights, index = p.router(x, *p.router_args)
        w, i = moe.route(logits, p.routing.top_k, p.routing.rule, p.routing.renormalize)
        assert torch.equal(i, index) and torch.equal(w, weights)
        want = p.experts(x, index, weights)  # the module in bf16
        ref = p.experts.float()(x.float(), index, weights.float())
        p.experts.to(torch.bfloat16)
        got = static_moe.routed(p.experts, x, index, weights, p.gate)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = static_moe.routed(p.experts, x, index, weights, p.gate)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, got)
    assert (got.float() - ref).norm() / ref.norm() < 2e-2
    assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2


@pytest.mark.slow  # ~15 s
def test_gemma4_experts_beside_the_dense_mlp_through_the_gemv(interpret):  # noqa: F811
    """Gemma 4 26B-A4B's parallel branch (router and experts children of the decoder layer) takes the expert
    GEMV too, and its router runs as its declared parts (norm kernel, projection, routing kernel with the
    per-expert scales): tokens and drafts as the eager loop, the router and the experts equal their modules."""
    from tests.test_static_families import GEMMA_VARIANTS

    adapter, drafter = static_pair("gemma4", **GEMMA_VARIANTS["moe_branch"])
    eng = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, moe_rows=16)
    layer = eng.target.layers[0]
    router, experts = layer.moe_branch[:2]
    x = torch.randn(3, adapter.text_config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for p in (router.scale, router.per_expert_scale):  # away from their initial ones
            p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
        _, weights, index = router(x)
        got_w, got_i = eng.target.moe.branch_route(
            layer.branch_routing, router, x
        )  # the declared router's parts
        want = experts(x, index, weights)
        torch.testing.assert_close(static_moe.routed(experts, x, index, weights), want)
        # the declared activation (GELU's tanh form) computed in the down kernel
        assert layer.branch_gate is not None and layer.branch_gate.kind == "gelu_tanh"
        torch.testing.assert_close(
            static_moe.routed(experts, x * 3, index, weights, layer.branch_gate),
            experts(x * 3, index, weights),
        )
        silu = static_moe.routed(experts, x * 3, index, weights, ExpertGate("silu"))
        assert not torch.allclose(silu, experts(x * 3, index, weights), rtol=1e-3, atol=1e-4)
    assert torch.equal(got_i, index) and got_w.dtype == weights.dtype == torch.float32
    torch.testing.assert_close(got_w, weights, rtol=1e-6, atol=1e-7)
    cfg = GenerationConfig(max_new_tokens=12)
    prompt = _prompts(1)[0]
    eager, fast = _eager(adapter, drafter, prompt, cfg), eng.speculative(prompt, cfg)
    assert fast.output_ids == eager.output_ids
    assert [s.proposed for s in fast.steps] == [s.proposed for s in eager.steps]


SHARED_TYPES = [t for t in MOE_TYPES if _first_block(t)[1].shared_mlp is not None]


@pytest.mark.parametrize("model_type", SHARED_TYPES)
def test_one_row_shared_expert_folds_beside_the_routed_slices(interpret, model_type):  # noqa: F811
    """A gated shared expert in a one-row step: its gate's logit and the router's logits further outputs of its
    fused gate/up GEMV, its down GEMV's sums scaled by the gate's sigmoid and handed to the next norm with the
    routed slices (`Parts.more`); their total is the block's output, and tokens stay the eager loop's (fp32)."""
    adapter, drafter = static_pair(model_type)
    eng = fast_engine(adapter, drafter, MASK, max_len=48, graphs=False, gemv=True, fused_ops=True)
    t = eng.target
    folded = [i for i, m in enumerate(t.layers) if m.moe_parts is not None and t.fold_down[i]]
    assert folded and all(t.moe.shared_extra[i] == (True, True) for i in folded)
    experts = t.layers[folded[0]].moe_parts.router.weight.shape[0]
    assert t.moe.shared_gate_up[folded[0]].sizes[2:] == [1, experts]
    x = torch.randn(1, 1, adapter.text_config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = t.moe.sparse(folded[0], x, t.fold_down[folded[0]])
        want = t.layers[folded[0]].mlp(x)
    assert isinstance(got, Parts) and got.more is not None
    torch.testing.assert_close(
        got.total(x), want[0] if isinstance(want, tuple) else want, atol=1e-5, rtol=1e-4
    )
    cfg = GenerationConfig(max_new_tokens=6)
    prompt = _prompts(1)[0]
    assert eng.autoregressive(prompt, cfg).output_ids == _eager(adapter, drafter, prompt, cfg).output_ids
