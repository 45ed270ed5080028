"""The Gated-DeltaNet kernels (cuda/ops/gdn.py, run by `StaticGDN` with `kernel`) against the torch ops they
replace: the conv with its gates and window, the window's commit, the delta rule against transformers' own
recurrence, and a layer's prefill / step / verify / commit sequence with and without them (fp32, Triton's
interpreter on CPU). The engine-level comparison with the eager loop is `test_kernels.py`'s split-kernel test."""

from __future__ import annotations

import sys

import pytest
import torch
import transformers
from dflash_zoo.adapters import get_adapter

from dflash_zoo.cuda.ops import gdn as gdn_ops
from dflash_zoo.cuda.static.gdn import StaticGDN, conv_gates
from dflash_zoo.cuda.static.layout import resolve
from tests.test_kernels import interpret  # noqa: F401  (fixture)
from tests.tiny import target_config, tiny_auto_class


def _first_gdn(model_type: str, device: str = "cpu", dtype=torch.float32, **linear):
    """(the first GDN layer's modules, the adapter) of a tiny hybrid target; `linear` resizes its GDN heads."""
    config = target_config(model_type)
    for name, value in linear.items():
        setattr(config, name, value)
    torch.manual_seed(3)
    model = getattr(transformers, tiny_auto_class(model_type)).from_config(config, dtype=torch.float32)
    adapter = get_adapter(model_type)(model.to(device, dtype).eval())
    return next(m for m in resolve(adapter).layers if m.gdn is not None), adapter


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def layer(request):
    return _first_gdn(request.param)


def _pair(layer, verify: str = "recurrent") -> tuple[StaticGDN, StaticGDN]:
    """(torch ops, kernels) over the same modules, from the same random states; `verify` as
    `FastOptions.gdn_verify`."""
    m, adapter = layer
    ref, fast = (
        StaticGDN(m.gdn, m.gdn_parts, adapter.gdn_split, kernel=k, verify=verify) for k in (False, True)
    )
    assert fast.kernel and not ref.kernel
    gen = torch.Generator().manual_seed(0)
    for a, b in zip(ref.states(), fast.states(), strict=True):
        a.copy_(torch.randn(a.shape, generator=gen) * 0.5)
        b.copy_(a)
    return ref, fast


def _rows(t: int, width: int, seed: int, like: torch.Tensor | None = None) -> torch.Tensor:
    x = torch.randn(1, t, width, generator=torch.Generator().manual_seed(seed))
    return x if like is None else x.to(like)


PLAN = [("prefill", 9, None), ("step", 1, None), ("verify", 6, 3), ("step", 1, None), ("verify", 6, 6)]


def _run(gdn: StaticGDN, plan=PLAN, like=None) -> list[torch.Tensor]:
    """A layer's outputs, then its states, over a plan of (mode, rows, rows committed after a verify)."""
    hidden, outs = gdn.in_proj.weight.shape[1], []
    with torch.no_grad():
        for i, (mode, t, n) in enumerate(plan):
            outs.append(gdn(_rows(t, hidden, 10 + i, like), mode))
            if n is not None:
                gdn.commit(torch.tensor(n, device=outs[-1].device))
    return [*outs, *(s.clone() for s in gdn.states())]


@pytest.mark.parametrize(("mode", "t"), [("step", 1), ("verify", 6), ("prefill", 2), ("prefill", 37)])
def test_conv_gates_equal_the_torch_ops(interpret, layer, mode, t):  # noqa: F811
    """q, k, v, g, beta and the window after the op (moved on, or kept by a verify) as the torch ops give them;
    37 prefill rows span three row blocks, 2 are fewer than the window."""
    ref, fast = _pair(layer)
    g_mod = ref.gdn
    mixed = _rows(t, ref.conv1d.in_channels, 1)
    b, a = _rows(t, g_mod.num_v_heads, 2), _rows(t, g_mod.num_v_heads, 3) * 3
    _, want = ref._conv_gates(mixed, b, a, mode)
    got = conv_gates(mixed, fast.window, fast.conv1d, g_mod, b, a, mode)
    for name, w, g in zip("q k v g beta".split(), want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=name)
        assert g.is_contiguous(), name
    torch.testing.assert_close(fast.window, ref.window, atol=0, rtol=0)
    if mode == "verify":
        assert not torch.equal(fast.window, _conv_window(mixed, fast.window, t))  # a verify keeps its window


def _conv_window(mixed, window, n):
    """The last K-1 conv inputs after the first n rows of `mixed`, by torch ops."""
    full = torch.cat([window, mixed.transpose(1, 2)], dim=-1)
    return full[..., n : n + window.shape[-1]]


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_window_commit_keeps_the_inputs_before_row_n(interpret, layer, n):  # noqa: F811
    _, fast = _pair(layer)
    mixed = _rows(6, fast.conv1d.in_channels, 4)
    want = _conv_window(mixed, fast.window, n).clone()
    gdn_ops.window_commit(mixed, fast.window, torch.tensor(n))
    torch.testing.assert_close(fast.window, want, atol=0, rtol=0)


def _qkv(gdn_mod, t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv = gdn_mod.num_k_heads, gdn_mod.num_v_heads, gdn_mod.head_k_dim, gdn_mod.head_v_dim
    q, k = (torch.randn(1, t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(1, t, hv, dv, generator=gen)
    g = -torch.rand(1, t, hv, generator=gen)  # log decays <= 0
    beta = torch.rand(1, t, hv, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("rows", [1, 5])
def test_delta_rule_is_the_reference_recurrence(interpret, layer, rows):  # noqa: F811
    """Outputs and final state as transformers' recurrence over heads repeated per value head; the kernel groups
    them itself. A commit (no query, n of the rows) leaves the state the reference reaches after n rows."""
    ref, fast = _pair(layer)
    home = sys.modules[type(ref.gdn).__module__]
    q, k, v, g, beta = _qkv(ref.gdn, rows, 5)
    rep = ref.gdn.num_v_heads // ref.gdn.num_k_heads
    want_o, want_s = home.torch_recurrent_gated_delta_rule(
        *(y.repeat_interleave(rep, 2) for y in (q, k)), v, g=g, beta=beta, initial_state=ref.state.clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    state = ref.state.clone()
    got = gdn_ops.delta_rule(q, k, v, g, beta, state, None)
    torch.testing.assert_close(got, want_o, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state, want_s, atol=1e-5, rtol=1e-4)
    kept = ref.state.clone()
    gdn_ops.delta_rule(q, k, v, g, beta, kept, None, store=False)
    assert torch.equal(kept, ref.state)  # outputs only: the state stays
    n = max(1, rows - 2)
    _, want_n = home.torch_recurrent_gated_delta_rule(
        *(y[:, :n].repeat_interleave(rep, 2) for y in (q, k)), v[:, :n], g=g[:, :n], beta=beta[:, :n],
        initial_state=ref.state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    committed = ref.state.clone()
    assert gdn_ops.delta_rule(None, k, v, g, beta, committed, torch.tensor(n)).numel() == 0
    torch.testing.assert_close(committed, want_n, atol=1e-5, rtol=1e-4)
    if n < rows:
        assert not torch.allclose(committed, want_s, atol=1e-3)  # not the state after all rows


@pytest.mark.parametrize("verify", ["chunk", "recurrent"])
def test_layer_with_kernels_equals_the_torch_layer(interpret, layer, verify):  # noqa: F811
    """Prefill, one-row steps, a verify (chunked, or through `delta_rule`) and commits of 3 then all rows:
    outputs and states as the torch ops'."""
    ref, fast = _pair(layer, verify)
    assert _pair(layer)[1].recurrent_verify  # the default
    assert fast.recurrent_verify == (verify == "recurrent")
    for i, (a, b) in enumerate(zip(_run(fast), _run(ref), strict=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"output or state {i}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_layer_kernels_on_cuda_at_real_head_sizes(model_type):
    """Qwen3.5's GDN head sizes (Dk = Dv = 128, two value heads per key head): fp32 as the torch layer (with
    flash-linear-attention where installed); bf16 close to fp32; a captured step and commit replay as run."""
    sizes = dict(
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8
    )
    layer = _first_gdn(model_type, "cuda", **sizes)
    ref, fast = _pair(layer)
    like = fast.state
    got, want = _run(fast, like=like), _run(ref, like=like)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3, msg=f"output or state {i}")
    layer[1].model.to(torch.bfloat16)
    m, adapter = layer
    half = StaticGDN(m.gdn, m.gdn_parts, adapter.gdn_split, kernel=True)
    x16 = torch.empty(0, device="cuda", dtype=torch.bfloat16)
    for i, (a, b) in enumerate(zip(_run(half, like=x16)[:5], got[:5], strict=True)):
        assert (a.float() - b).norm() / b.norm() < 3e-2, f"bf16 output {i}"
    x, n = _rows(1, half.in_proj.weight.shape[1], 30, x16), torch.tensor(4, device="cuda")
    block = _rows(6, x.shape[-1], 31, x16)
    start = [s.clone() for s in half.states()]
    with torch.no_grad():
        eager = (half(x, "step"), half(block, "verify"))
        half.commit(n)
        ran = [s.clone() for s in half.states()]
        for s, s0 in zip(half.states(), start, strict=True):
            s.copy_(s0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = (half(x, "step"), half(block, "verify"))
            half.commit(n)
        for s, s0 in zip(half.states(), start, strict=True):
            s.copy_(s0)
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip([*replayed, *half.states()], [*eager, *ran], strict=True):
        assert torch.equal(a, b)
